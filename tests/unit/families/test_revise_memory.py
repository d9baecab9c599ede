"""DiffusionGemma's step in one (L, V) buffer a row (issue #46): the in-place step is the plain one bit
for bit, and a step's full-vocabulary float32 memory stays at one buffer per running canvas plus a
bounded transient, measured with torch's profiler (its allocation events), not by patching anything."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from celeris.engine.families.revise import slots as slots_mod
from celeris.engine.families.revise.config import gemma_config
from celeris.engine.families.revise.sampler import (ReviseParams, RowNoise, denoise_row, denoise_row_, entropy,
                                                    entropy_chunked, softmax_, tempered)
from celeris.engine.families.revise.slots import SlotState, generate, step_rows
from celeris.engine.families.revise.weights import random_gemma

P = ReviseParams(max_denoising_steps=6, entropy_bound=2.0, t_min=0.1, t_max=0.4, confidence_threshold=5.0)


@pytest.mark.parametrize("L,V", [(12, 48), (5, 96), (33, 1000), (256, 4096)])
def test_the_in_place_step_is_the_plain_step_bit_for_bit(L, V):
    g = torch.Generator().manual_seed(L + V)
    for steps_left in (6, 3, 1):
        logits = torch.randn(L, V, generator=g) * 4
        logits[: L // 2, :3] = float("-inf")  # min_tokens' bans
        a, b = RowNoise(7, V, L), RowNoise(7, V, L)
        plain = denoise_row(logits, a.uniform_canvas(), steps_left, P, a)
        b.uniform_canvas()
        mine = denoise_row_(logits.clone(), steps_left, P, b, keep_tempered=True)
        scaled = tempered(logits, steps_left, P)
        assert torch.equal(mine.canvas, plain.canvas) and torch.equal(mine.argmax, plain.argmax)
        assert torch.equal(mine.tempered, scaled)
        assert torch.equal(mine.probs, torch.softmax(scaled, -1, dtype=torch.float32))
        assert torch.equal(mine.confidence, torch.softmax(scaled, -1).amax(-1))  # what the runner showed
        assert float(mine.mean_entropy) == plain.mean_entropy
        assert bool(mine.confident) == bool(entropy(scaled).mean(-1) < P.confidence_threshold)
        assert torch.equal(a.uniform_canvas(), b.uniform_canvas())  # the same stream consumed


@pytest.mark.parametrize("L", [1, 2, 31, 33, 65, 256])
def test_chunked_reductions_equal_the_whole(L):
    x = torch.randn(L, 3000, generator=torch.Generator().manual_seed(L)) * 6
    assert torch.equal(entropy_chunked(x), entropy(x))
    assert torch.equal(softmax_(x.clone()), torch.softmax(x, -1, dtype=torch.float32))


def test_draw_in_place_is_torch_multinomial():
    probs = torch.softmax(torch.randn(64, 5000) * 3, -1)
    for seed in range(4):
        a, b = RowNoise(seed, 5000, 64), RowNoise(seed, 5000, 64)
        assert torch.equal(a.draw(probs), b.draw_(probs))


def _model(vocab: int, canvas: int, dtype: str = "float32"):
    raw = {"architectures": ["DiffusionGemmaForBlockDiffusion"], "canvas_length": canvas, "text_config": {
        "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "global_head_dim": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
        "num_experts": 4, "top_k_experts": 2, "vocab_size": vocab, "sliding_window": 8}}
    return random_gemma(gemma_config(raw), dtype, seed=1)


def test_one_transfer_a_step_and_seeded_rows_decode_alike_alone_and_batched(monkeypatch):
    model = _model(512, 16)
    jobs = [([2, 5, 6], 0), ([2, 9], 3), ([2, 40, 41, 42], 5)]
    solo = [generate(model, pr, P, seed, 32) for pr, seed in jobs]
    calls = []
    host_values = slots_mod._host_values
    monkeypatch.setattr(slots_mod, "_host_values", lambda rows: calls.append(len(rows)) or host_values(rows))
    seqs = [SlotState(model, pr, P, seed, 32, (), 0) for pr, seed in jobs]
    steps = 0
    while not all(s.finished for s in seqs):
        step_rows(model, seqs)
        steps += 1
    assert [s.final for s in seqs] == solo
    assert len(calls) == steps and calls[0] == len(jobs)  # one transfer a step, every row in it


def step_memory(model, batch: int, warm: int = 2) -> dict:
    """One steady-state step of `batch` rows (each past its first step, so holding its self-conditioning
    input): the bytes the rows hold between steps in (L, V) tensors, and the step's peak of live CPU
    allocations above its start, from the profiler's allocation and free events in time order (the
    warm-up steps are profiled too, so every buffer the step frees was allocated in view)."""
    cfg = model.cfg
    p = ReviseParams(max_denoising_steps=warm + 4, confidence_threshold=0.0)
    seqs = [SlotState(model, [2, 5 + r], p, r, cfg.canvas_length, (), 0) for r in range(batch)]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(warm):
            step_rows(model, seqs)
        held = sum(t.nbytes for s in seqs for t in vars(s).values()
                   if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[-1] == cfg.vocab_size)
        with record_function("measured step"):
            step_rows(model, seqs)
    events = list(prof.profiler.kineto_results.events())
    mark = next(e for e in events if e.name() == "measured step")
    start, end = mark.start_ns(), mark.start_ns() + mark.duration_ns()
    live, at_start, peak, full = 0, None, 0, cfg.canvas_length * cfg.vocab_size * 4
    allocs = 0
    for t, n in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        if t >= start and at_start is None:
            at_start = live
        live += n
        if start <= t <= end:
            peak = max(peak, live - at_start)
            allocs += n >= full
    return {"held": held, "peak": peak, "full": full, "full_allocs": allocs}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_step_holds_one_full_vocabulary_buffer_a_row_and_a_bounded_transient(dtype):
    model = _model(20000, 64, dtype)
    for batch in (1, 4):
        m = step_memory(model, batch)
        # the self-conditioning input, one (L, V) a row in the weights' dtype (bf16: half a float32 one)
        assert m["held"] == batch * m["full"] // (2 if dtype == "bfloat16" else 1)
        # transient: the forward's logits (the row's next buffer) + the draw's exponentials + chunks,
        # whatever the batch (the old step held B logits, a stacked copy and several temporaries a row)
        assert m["peak"] <= 2.5 * m["full"] + 8 * 2**20, m
