"""EOS handling: a finished block holding EOS ends generation, fills the rest, trims the output."""

from __future__ import annotations

import torch

from celeris.engine.sampling.params import SamplingParams
from celeris.engine.sampling.reference import reference_generate
from celeris.engine.families.canvas.sequence import CanvasSequence
from celeris.engine.events import FinishReason

MASK, EOS = 3, 2


def seq(**kw):
    params = SamplingParams(**({"gen_length": 8, "steps": 4, "block_length": 4, "seed": 0} | kw))
    return CanvasSequence("r", [1, 10, 11], params, mask_id=MASK, stop_ids=frozenset({EOS}))


def test_eos_in_finished_block_stops_and_fills_canvas():
    s = seq()
    s.apply([0, 1], [20, EOS], [0.9, 0.8])  # EOS committed, block not finished yet
    assert not s.finished
    ev = s.apply([2, 3], [21, 22], [0.7, 0.6])  # block 0 complete -> stop
    assert ev.finished and ev.finish_reason is FinishReason.STOP and ev.block_complete
    assert s.canvas == [20, EOS, 21, 22, EOS, EOS, EOS, EOS]
    assert s.generated() == [20]  # everything from the first EOS on is trimmed
    assert s.nfe == 2  # 2 of the 4 planned forward passes


def test_no_eos_runs_every_block_to_length():
    s = seq()
    for pos in ([0, 1], [2, 3]):
        s.apply(pos, [20, 21], [0.9, 0.9])
    assert not s.finished and s.block == 1
    for pos in ([0, 1], [2, 3]):
        ev = s.apply(pos, [22, 23], [0.9, 0.9])
    assert ev.finish_reason is FinishReason.LENGTH and s.generated() == [20, 21, 20, 21, 22, 23, 22, 23]


def test_stop_at_eos_off_keeps_decoding():
    s = seq(stop_at_eos=False)
    s.apply([0, 1], [EOS, EOS], [0.9, 0.9])
    s.apply([2, 3], [EOS, EOS], [0.9, 0.9])
    assert not s.finished and s.block == 1


def boost_eos_at(model, window_pos: int):
    """Make the model put EOS at block-relative position `window_pos` (runner head calls only)."""
    orig = model.head

    def head(h):
        logits = orig(h)
        if logits.shape[1] <= 8:  # the runner evaluates the head on the block window only
            logits[:, window_pos, EOS] += 1e4
        return logits

    return head


def test_runner_stops_early_on_eos(tiny_llm, monkeypatch):
    monkeypatch.setattr(tiny_llm.model, "head", boost_eos_at(tiny_llm.model, 2))
    ids = tiny_llm.encode_prompt("It is a truth")
    res = tiny_llm.generate([ids], SamplingParams(gen_length=32, steps=32, block_length=8, seed=0))[0]
    assert res.finish_reason is FinishReason.STOP
    assert res.steps == 8  # stopped after the first block instead of running all 32 steps
    assert len(res.token_ids) == 2  # the two tokens before EOS
    assert tiny_llm.tokenizer.eos_id not in res.token_ids


def test_reference_mode_stops_early_and_fills_eos(tiny_llm):
    mask = tiny_llm.tokenizer.mask_id

    def model(ids, _mask):
        logits = tiny_llm.model(ids)
        logits[:, ids.shape[1] - 16 + 1, EOS] += 1e4  # EOS at generated position 1, block 0
        return logits

    ids = torch.tensor([tiny_llm.encode_prompt("It is a truth")])
    out, nfe = reference_generate(model, ids, SamplingParams(gen_length=16, steps=16, block_length=4), mask,
                                  stop_ids=tiny_llm.tokenizer.stop_ids)
    gen = out[0, ids.shape[1]:].tolist()
    assert nfe == 4 and gen[1] == EOS and gen[4:] == [EOS] * 12


def test_block_sequence_events_carry_the_same_truth():
    """Block-diffusion requests build their step events through the same helper: output view,
    settled positions, a ticket of their own."""
    from celeris.engine.families.block.sequence import BlockSequence
    from celeris.engine.sampling.params import SamplingParams

    p = SamplingParams(gen_length=8, steps=8, block_length=4, seed=0)
    a = BlockSequence("r", [1, 2, 3, 4, 5, 6], p, mask_id=99, stop_ids=frozenset({0}))
    b = BlockSequence("r", [1, 2, 3, 4, 5, 6], p, mask_id=99, stop_ids=frozenset({0}))
    assert a.ticket and a.ticket != b.ticket
    ev = a.apply([], [], [])  # the prefill forward (prompt block 0)
    assert len(ev.canvas) == 8 and ev.generated == () and ev.settled == 0 and ev.ticket == a.ticket
    ev = a.apply([2, 3], [7, 8], [0.9, 0.8])  # block 1 holds prompt tail 4..5, decodes 6..7
    assert ev.block_complete and ev.generated == (7, 8) and ev.settled == 2 and ev.committed == (0, 1)
    ev = a.cancel()
    assert ev.finished and ev.settled == 8 and ev.generated == tuple(a.generated())
