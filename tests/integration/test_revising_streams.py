"""A revising model (DiffusionGemma) served over gRPC and HTTP on free ports: the stream contract.

Every position a message shows is final or may still change; a revising model's canvas being
denoised is shown and revised (a later message replaces tokens shown before), committed canvases
are final and never change; plain OpenAI streaming sends only final text. Mask models mark every
committed position final. Tiny random DiffusionGemma checkpoint written by transformers' classes.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from celeris_client.client import CelerisClient  # noqa: E402
from celeris.engine.config import EngineConfig  # noqa: E402
from celeris.engine.llm import LLM  # noqa: E402
from tests.integration.live_server import live_server  # noqa: E402
from tests.integration.http_helpers import post, sse_events  # noqa: E402
from tests.unit.revise_references.gemma_checkpoint import write_checkpoint, write_tokenizer  # noqa: E402

PROMPT = "w5 w6 w7"  # ids [2, 5, 6, 7] with the BOS
KNOBS = dict(gen_length=16, seed=3, max_denoising_steps=5, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma_llm(tmp_path_factory):
    folder = write_tokenizer(write_checkpoint(tmp_path_factory.mktemp("dg-live"), canvas_length=8, seed=8))
    return LLM.load(folder, EngineConfig(max_batch=4, max_queue=8, max_prompt_tokens=32, max_gen_length=64))


@pytest.fixture(scope="module")
def live(gemma_llm):
    with live_server(gemma_llm, warmup=True) as s:  # the real start-up path, warm-up included
        yield s


def _library(llm) -> list[int]:
    """The library-level decode of PROMPT with KNOBS (the server is idle when tests call it)."""
    from celeris.engine.families.revise.runner import revise_params
    from celeris.engine.families.revise.slots import generate

    params = llm.defaults.__class__(**(llm.defaults.__dict__ | KNOBS))
    return generate(llm.model, [2, 5, 6, 7], revise_params(params), KNOBS["seed"], 16, (), 0)


def _check_contract(snaps) -> int:
    """Final positions never change and the final prefix only grows; returns positions revised."""
    final: dict[int, int] = {}
    revised, prefix = 0, 0
    for s in snaps:
        assert s.final_positions >= prefix
        prefix = s.final_positions
        for i, t in enumerate(s.tokens):
            if t.final or i < s.final_positions:
                assert t.final and final.setdefault(i, t.id) == t.id, (s.step, i)
        revised += len(s.revised)
    return revised


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
@pytest.mark.parametrize("fmt", ["full", "delta"])
def test_grpc_streams_show_revisions_and_final_positions(live, gemma_llm, fmt):
    with CelerisClient(live.grpc_target) as c:
        info = c.model_info()
        snaps = list(c.stream(PROMPT, stream_format=fmt, **KNOBS))
    assert info.architecture == "diffusion-gemma" and info.mask_token_id == info.vocab_size == 96
    assert (info.family, info.token_editing) == ("revise", False)
    assert (info.defaults.max_denoising_steps, info.defaults.stability_threshold) == (48, 1)
    assert all(s.revising for s in snaps)
    assert _check_contract(snaps) > 0  # the canvas being denoised changed what it had shown
    mid = [s for s in snaps[:-1] if 0 < s.final_positions < 16]
    assert len(mid) > 1 and all(not t.final and not t.masked for t in mid[1].tokens[8:])  # shown, may change
    want = _library(gemma_llm)
    last = snaps[-1]
    assert last.done and [t.id for t in last.tokens] == want and all(t.final for t in last.tokens)
    assert last.text == gemma_llm.detokenize(want)


def test_delta_rebuilds_the_full_stream(live):
    with CelerisClient(live.grpc_target) as c:
        full = list(c.stream(PROMPT, stream_format="full", **KNOBS))
        delta = list(c.stream(PROMPT, stream_format="delta", **KNOBS))
    strip = lambda s: [(t.id, t.masked, t.final) for t in s.tokens]  # noqa: E731
    assert [strip(s) for s in delta] == [strip(s) for s in full]
    assert [s.revised for s in delta] == [s.revised for s in full]


def test_openai_plain_streaming_sends_only_final_text(live, gemma_llm):
    body = {"prompt": PROMPT, "stream": True, "max_tokens": 16, "seed": 3, "max_denoising_steps": 5,
            "ignore_eos": True}
    events = [e for e in sse_events(post(live, "/v1/completions", body)) if e != "[DONE]"]
    texts = [e["choices"][0]["text"] for e in events if e["choices"]]
    want = json.loads(post(live, "/v1/completions", body | {"stream": False}).read())["choices"][0]["text"]
    assert "".join(texts) == want
    # One chunk per committed canvas at most (two canvases), never a provisional token's text.
    assert len([t for t in texts if t]) <= 2
    assert texts[0] == gemma_llm.detokenize(_library(gemma_llm)[:8])  # exactly the first committed canvas


def test_stop_strings_cut_final_text_on_every_door(live, gemma_llm):
    """A stop string from the second canvas: HTTP (plain streaming and not) and gRPC end with
    `stop`, the text cut where it begins, and the streamed text never holds it."""
    ids = _library(gemma_llm)
    full = gemma_llm.detokenize(ids)
    stop = gemma_llm.tokenizer.token_text(ids[11]).strip()
    want = full[:full.index(stop)]
    body = {"prompt": PROMPT, "max_tokens": 16, "seed": 3, "max_denoising_steps": 5, "ignore_eos": True,
            "stop": [stop]}
    plain = json.loads(post(live, "/v1/completions", body).read())["choices"][0]
    assert (plain["text"], plain["finish_reason"]) == (want, "stop")
    events = [e for e in sse_events(post(live, "/v1/completions", body | {"stream": True})) if e != "[DONE]"]
    texts = [e["choices"][0]["text"] for e in events if e["choices"]]
    assert "".join(texts) == want and all(stop not in t for t in texts)
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "stop"
    with CelerisClient(live.grpc_target) as c:
        snaps = list(c.stream(PROMPT, stop=[stop], **KNOBS))
    assert snaps[-1].done and snaps[-1].text == want and snaps[-1].finish_reason == "stop"


def test_sse_diffusing_delta_cells_say_final_and_revise(live):
    body = {"prompt": PROMPT, "stream": True, "diffusing": True, "max_tokens": 16, "seed": 3,
            "max_denoising_steps": 5, "ignore_eos": True}
    events = [e for e in sse_events(post(live, "/v1/completions", body)) if e != "[DONE]" and e["choices"]]
    c0 = events[0]["celeris"]
    assert c0["layout"]["revising"] is True
    cells: dict[int, dict] = {}
    replaced = 0
    for e in events[:-1]:
        for u in e["celeris"]["updates"]:
            old = cells.get(u["i"])
            if old is not None:
                assert not old["final"], "a final cell never changes"
                replaced += not old["masked"] and not u["masked"] and old["text"] != u["text"]
            cells[u["i"]] = u
        fp = e["celeris"]["final_positions"]
        assert all(cells[i]["final"] for i in range(fp))
    assert replaced > 0
    last = events[-1]["celeris"]
    assert all(t["final"] for t in last["tokens"]) and last["final_positions"] == 16


def test_mask_models_mark_committed_positions_final(tiny_llm):
    with live_server(tiny_llm) as s, CelerisClient(s.grpc_target) as c:
        snaps = list(c.stream("It is a truth", gen_length=16, steps=8, block_length=8, seed=1, stream_format="delta"))
    for s in snaps:
        assert not s.revising and not s.revised
        assert all(t.final == (not t.masked) for t in s.tokens)


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_concurrent_requests_through_the_scheduler_decode_their_solo_text(live, gemma_llm):
    """Requests of different seeds and lengths streamed at once share the scheduler's steps; each
    decodes what the library decodes for it alone."""
    from concurrent.futures import ThreadPoolExecutor

    from celeris.engine.families.revise.runner import revise_params
    from celeris.engine.families.revise.slots import generate

    jobs = [(3, 16), (4, 8), (5, 24), (6, 16)]

    def run(job):
        seed, n = job
        with CelerisClient(live.grpc_target) as c:
            return c.generate(PROMPT, **(KNOBS | {"seed": seed, "gen_length": n}))

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    for (seed, n), res in zip(jobs, results):
        params = gemma_llm.defaults.__class__(**(gemma_llm.defaults.__dict__ | KNOBS))
        want = generate(gemma_llm.model, [2, 5, 6, 7], revise_params(params), seed, n, (), 0)
        assert [t.id for t in res.tokens] == want, seed


def test_each_family_refuses_the_others_knobs_by_name(live, tiny_llm):
    from celeris_client.errors import InvalidArgument

    with CelerisClient(live.grpc_target) as c, pytest.raises(InvalidArgument) as e:
        c.generate(PROMPT, temperature=0.5, **KNOBS)
    assert [v.field for v in e.value.field_violations] == ["temperature"]
    resp = post(live, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "top_p": 0.5})
    assert resp.status == 400 and json.loads(resp.read())["error"]["param"] == "top_p"
    with live_server(tiny_llm) as s, CelerisClient(s.grpc_target) as c, pytest.raises(InvalidArgument) as e:
        c.generate("It is a truth", gen_length=8, steps=8, block_length=8, t_max=0.9)
    assert [v.field for v in e.value.field_violations] == ["t_max"]


def test_logprobs_on_both_doors(live, gemma_llm):
    """With logprobs, every generated token carries its log-probability and alternatives, on the
    last gRPC message and in the OpenAI response; the text is the text decoded without them."""
    ids = _library(gemma_llm)
    with CelerisClient(live.grpc_target) as c:
        last = list(c.stream(PROMPT, logprobs=2, **KNOBS))[-1]
    assert [t.id for t in last.tokens] == ids
    assert all(t.logprob is not None and t.logprob <= 0 and len(t.top_logprobs) == 2 for t in last.tokens)
    body = {"prompt": PROMPT, "max_tokens": 16, "seed": 3, "max_denoising_steps": 5, "ignore_eos": True,
            "logprobs": 2}
    choice = json.loads(post(live, "/v1/completions", body).read())["choices"][0]
    assert choice["text"] == gemma_llm.detokenize(ids)
    assert choice["logprobs"]["token_logprobs"] == pytest.approx([t.logprob for t in last.tokens], abs=1e-5)


def test_n_samples_are_the_solo_decodes_of_consecutive_seeds(live, gemma_llm):
    """n = 3 in one call: sample j decodes what a request alone with seed + j decodes, each with its
    own random stream though all three share every forward."""
    from celeris.engine.families.revise.runner import revise_params
    from celeris.engine.families.revise.slots import generate

    with CelerisClient(live.grpc_target) as c:
        results = c.sample(PROMPT, 3, **KNOBS)
    params = gemma_llm.defaults.__class__(**(gemma_llm.defaults.__dict__ | KNOBS))
    for j, r in enumerate(results):
        want = generate(gemma_llm.model, [2, 5, 6, 7], revise_params(params), KNOBS["seed"] + j, 16, (), 0)
        assert (r.seed, [t.id for t in r.tokens]) == (KNOBS["seed"] + j, want), j
    assert len({tuple(t.id for t in r.tokens) for r in results}) == 3
