"""DiffusionGemma steps every running request in one denoiser forward, and each decodes exactly what
it decodes alone and what transformers' generate() decodes for it (issue 62).

Eight mixed requests (prompts of 2-9 tokens, one outgrowing the sliding window and one shorter than
a GEMM's ROW_ALIGN rows; seeds; one or two canvases; sampler settings that run out of steps, stop
on the stable-and-confident rule, stop confident at stability 0, and a near-greedy one) share the
served step loop: one denoiser forward a step (the step stats' `forwards`), whatever canvas and
step each row is at, their new context in one encoder forward. The checkpoint amplifies rounding
(top-3 routing over 8 experts, the self-conditioning GLU scaled 8x), so a last-bit difference in
a row's logits would show as different tokens. Tiny random checkpoint written by transformers'
classes; CPU, float32, one thread.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers")

from celeris.engine.config import EngineConfig  # noqa: E402
from celeris.engine.families.revise.rows import ROW_ALIGN, expert_passes, packs  # noqa: E402
from celeris.engine.families.revise.sampler import ReviseParams  # noqa: E402
from celeris.engine.families.revise.slots import SlotState, generate, step_rows  # noqa: E402
from celeris.engine.llm import LLM  # noqa: E402
from celeris.engine.loop.step_loop import StepLoop  # noqa: E402
from tests.unit.gemma_helpers import PARAMS, gen_kwargs  # noqa: E402
from tests.unit.revise_references.gemma_checkpoint import (  # noqa: E402
    reference_generate, reference_model, write_checkpoint, write_tokenizer)

GREEDY = ReviseParams(max_denoising_steps=6, entropy_bound=1.0, t_min=0.0, t_max=0.001, stability_threshold=1,
                      confidence_threshold=2.5)  # temperature <= 0.001: each draw is the argmax
SETTINGS = {**PARAMS, "greedy": GREEDY}
JOBS = [  # (prompt, seed, settings, max_new_tokens)
    ([2, 5, 6, 7], 0, "steps", 16),
    ([2, 9, 10, 11, 12, 13, 14, 15, 16], 3, "rule", 10),  # outgrows the sliding window (6)
    ([2, 40], 5, "confident", 16),  # shorter than ROW_ALIGN: its prompt is encoded in a forward of its own
    ([2, 9, 10, 11], 7, "greedy", 8),
    ([2, 33, 34, 35, 36, 37], 11, "rule", 16),
    ([2, 70, 71, 72, 73], 13, "greedy", 16),
    ([2, 5, 6, 7], 17, "steps", 8),  # the first prompt, another seed
    ([2, 60, 61, 62, 63, 64, 65], 19, "confident", 10),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes; these machines are shared
    yield write_tokenizer(write_checkpoint(tmp_path_factory.mktemp("dg-one-forward"), canvas_length=8, seed=11,
                                           sc_gain=8.0, num_experts=8, top_k_experts=3))
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llm(folder):
    return LLM.load(folder, EngineConfig(max_batch=8, max_queue=8, max_prompt_tokens=32, max_gen_length=64))


@pytest.fixture(scope="module")
def solo(llm):
    return [generate(llm.model, pr, SETTINGS[pn], seed, new, (), 0) for pr, seed, pn, new in JOBS]


def _params(llm: LLM, pname: str, seed: int, new: int):
    p = SETTINGS[pname]
    return replace(llm.defaults, gen_length=new, block_length=new, steps=1, seed=seed, ignore_eos=True,
                   **{f: getattr(p, f) for f in ReviseParams.__dataclass_fields__})


def test_eight_mixed_requests_share_one_denoiser_forward_a_step_and_decode_their_solo_tokens(llm, solo):
    loop = StepLoop(llm.runner, max_queue=8)
    seqs = [llm.sequence(pr, _params(llm, pn, seed, new)) for pr, seed, pn, new in JOBS]
    for s in seqs:
        loop.add(s)
    forwards, batches, encodes = [], [], []
    while not loop.idle:
        before = llm.model.calls.encode
        _, record = loop.step()
        forwards.append(record.stats.forwards)
        batches.append(record.stats.batch)
        encodes.append(llm.model.calls.encode - before)
    assert batches[0] == len(JOBS) and len(set(batches)) > 1  # all at once; they finish at different steps
    assert forwards == [1] * len(forwards)
    assert encodes[0] == 2  # the prompts: the 2-token one alone, the seven others together
    assert max(encodes[1:]) == 1  # canvases committed at one step: encoded together at the next
    got = [llm.result(s).token_ids for s in seqs]
    assert got == solo


def test_the_library_step_runs_one_forward_for_any_mix_and_order(llm, solo):
    """Rows joining at different steps, in another order, through `step_rows` itself."""
    model, order = llm.model, [5, 2, 7, 0, 3, 6, 1, 4]
    seqs: list[SlotState] = []
    step = 0
    while len(seqs) < len(order) or not all(s.finished for s in seqs):
        if len(seqs) < len(order) and step % 2 == 0:  # a request joins every other step
            pr, seed, pn, new = JOBS[order[len(seqs)]]
            seqs.append(SlotState(model, pr, SETTINGS[pn], seed, new, (), 0, batched_encoding=True))
        before = model.calls.denoise
        step_rows(model, seqs)
        assert model.calls.denoise - before == 1
        step += 1
    assert [s.final for s in seqs] == [solo[j] for j in order]


@pytest.mark.slow  # eight transformers generate() runs
def test_every_request_decodes_what_transformers_generate_decodes(folder, solo):
    ref = reference_model(folder)
    for (prompt, seed, pname, new), mine in zip(JOBS, solo):
        assert mine == reference_generate(ref, prompt, seed, new, **gen_kwargs(SETTINGS[pname])), (prompt, seed)


def test_packs_keep_short_requests_alone():
    assert packs([8, 8, 8], shared=True) == [[0, 1, 2]]
    assert packs([9, 2, 4, 1], shared=True) == [[0, 2], [1], [3]]
    assert packs([8, 8], shared=False) == [[0], [1]]  # CUDA's exact mode: each row its own forward
    assert packs([ROW_ALIGN - 1] * 3, shared=True) == [[0], [1], [2]]


def test_expert_passes_group_big_rows_and_keep_small_groups_alone():
    """Three requests' (token, slot) pairs per expert: an expert's groups of >= ROW_ALIGN pairs share
    pass 0; each smaller group is a pass of its own, with exactly its own rows."""
    counts = torch.tensor([[5, 1, 0, 2],
                           [4, 2, 0, 0],
                           [0, 3, 6, 1]])  # (R, E)
    starts = (counts.reshape(-1).cumsum(0) - counts.reshape(-1)).view(3, 4)
    passes = expert_passes(counts)
    assert [c.tolist() for _, c in passes] == [[9, 1, 6, 2], [0, 2, 0, 1], [0, 3, 0, 0]]
    seen = torch.cat([p for p, _ in passes]).sort().values
    assert torch.equal(seen, torch.arange(int(counts.sum())))  # every pair exactly once

    def rows(r, e):
        return list(range(int(starts[r, e]), int(starts[r, e] + counts[r, e])))
    assert passes[0][0].tolist() == rows(0, 0) + rows(1, 0) + rows(0, 1) + rows(2, 2) + rows(0, 3)
    assert passes[1][0].tolist() == rows(1, 1) + rows(2, 3)
    assert passes[2][0].tolist() == rows(2, 1)


def test_batch_invariance_flag_chooses_the_forward_on_cuda(folder, monkeypatch):
    """`--batch-invariant` (default): a forward a row on CUDA, one shared on the CPU; off: one shared
    forward on any device."""
    import argparse

    from celeris.engine.families.revise.model import DiffusionGemma
    from celeris.server.cli.args import add_model_args, engine_config_from_args

    ap = argparse.ArgumentParser()
    add_model_args(ap)
    exact, fast = (engine_config_from_args(ap.parse_args(flags), max_batch=2)
                   for flags in ([], ["--no-batch-invariant"]))
    assert (exact.batch_invariant, fast.batch_invariant) == (True, False)
    models = [LLM.load(folder, config).model for config in (exact, fast)]
    assert [m.shares_forwards for m in models] == [True, True]  # the CPU: exact either way
    monkeypatch.setattr(DiffusionGemma, "device", property(lambda self: torch.device("cuda")))
    assert [m.shares_forwards for m in models] == [False, True]
