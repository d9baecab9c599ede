"""DiffusionGemma on CUDA (issue #46; skipped without CUDA): the step runs on the device, every row's
state lives there, a seeded request decodes the same tokens alone or in any batch on that device
(its random stream is a generator on the device, so not the CPU's tokens), and it is served over
gRPC and HTTP. Tiny random checkpoints written by transformers' classes, as the CPU tests use."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("transformers")

from celeris.engine.config import EngineConfig  # noqa: E402
from celeris.engine.families.revise.sampler import ReviseParams  # noqa: E402
from celeris.engine.families.revise.slots import SlotState, generate, step_rows  # noqa: E402
from celeris.engine.families.revise.weights import load_gemma  # noqa: E402
from celeris.engine.llm import LLM  # noqa: E402
from tests.unit.revise_references.gemma_checkpoint import write_checkpoint, write_tokenizer  # noqa: E402

P = ReviseParams(max_denoising_steps=6, entropy_bound=1.5, t_min=0.05, t_max=0.2, stability_threshold=1,
                 confidence_threshold=2.5)
JOBS = [([2, 5, 6, 7], 0, 16), ([2, 9, 10, 11, 12, 13, 14, 15, 16], 3, 10), ([2, 40], 5, 16), ([2, 9, 10], 7, 5)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tokenizer(write_checkpoint(tmp_path_factory.mktemp("dg-cuda"), canvas_length=8, seed=8))


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(folder, request):
    return load_gemma(folder, dtype=request.param, device="cuda")


def test_the_step_runs_on_the_device_and_keeps_its_state_there(model):
    seqs = [SlotState(model, pr, P, seed, new, (), 0) for pr, seed, new in JOBS]
    out = step_rows(model, seqs)
    assert all(not isinstance(r, Exception) for r in out), out
    for s in seqs:
        assert s.canvas.is_cuda and s.sc_probs.is_cuda and s.noise.gen.device.type == "cuda"
        assert all(k is None or k.is_cuda for k in s.cache.k)
        assert s.sc_probs.dtype == model.embed.weight.dtype  # the next forward's input, as it reads it


def test_seeded_requests_decode_alike_alone_and_in_any_batch_on_the_device(model):
    solo = [generate(model, pr, P, seed, new) for pr, seed, new in JOBS]
    for order in (JOBS, JOBS[::-1], JOBS[1:3]):
        seqs = [SlotState(model, pr, P, seed, new, (), 0) for pr, seed, new in order]
        while not all(s.finished for s in seqs):
            step_rows(model, seqs)
        assert [s.final for s in seqs] == [solo[JOBS.index(j)] for j in order]


def test_served_over_grpc_and_http_on_cuda(folder):
    """The served path on the device: gRPC's last snapshot and HTTP's text are the library's decode
    on the same device (the engine's own loop, warm-up included)."""
    from celeris_client.client import CelerisClient
    from celeris.engine.families.revise.runner import revise_params
    from tests.integration.http_helpers import post
    from tests.integration.live_server import live_server

    llm = LLM.load(folder, EngineConfig(device="cuda", max_batch=4, max_queue=8, max_prompt_tokens=32,
                                        max_gen_length=64))
    knobs = dict(gen_length=16, seed=3, max_denoising_steps=5, ignore_eos=True)
    params = llm.defaults.__class__(**(llm.defaults.__dict__ | knobs))
    want = generate(llm.model, [2, 5, 6, 7], revise_params(params), 3, 16, (), 0)
    body = {"prompt": "w5 w6 w7", "max_tokens": 16, "seed": 3, "max_denoising_steps": 5, "ignore_eos": True}
    with live_server(llm, warmup=True) as live:
        with CelerisClient(live.grpc_target) as c:
            snaps = list(c.stream("w5 w6 w7", **knobs))
        text = json.loads(post(live, "/v1/completions", body).read())["choices"][0]["text"]
    assert snaps[-1].done and [t.id for t in snaps[-1].tokens] == want
    assert text == llm.detokenize(want)
