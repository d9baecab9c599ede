"""Provisional predictions (SamplingParams.provisional): every step, the token the sampler ranked
first at each candidate it left masked in the current block, with the confidence it ranked by."""

from __future__ import annotations

import pytest
import torch

from celeris.engine.config import EngineConfig
from celeris.engine.errors import InvalidRequest
from celeris.engine.llm import LLM
from celeris.engine.sampling.params import SamplingParams
from tests.helpers import simulated_llm
from tests.unit.block_references.checkpoints import write_sdar_checkpoint


def run(llm, ids, **kw):
    seq = llm.sequence(ids, SamplingParams(**({"gen_length": 16, "steps": 8, "block_length": 8, "seed": 0,
                                                "stop_at_eos": False} | kw)))
    llm.loop.add(seq)
    events = []
    with torch.inference_mode():
        llm.loop.run_to_completion(events.append)
    return seq, events


def test_each_step_reports_the_argmax_and_probability_of_every_position_it_left_masked(tiny_llm):
    """Checked against an independent forward over the canvas each step started from."""
    ids = tiny_llm.encode_prompt("It is a truth universally")
    mask = tiny_llm.tokenizer.mask_id
    _, events = run(tiny_llm, ids, provisional=True)
    canvas = [mask] * 16
    checked = 0
    for ev in events:
        block = range(ev.block * 8, ev.block * 8 + 8)
        masked = {p for p in block if canvas[p] == mask}
        guessed = {p for p, _, _ in ev.provisional}
        assert guessed == masked - set(ev.committed)  # exactly the candidates it left masked
        assert all(ev.canvas[p] == mask for p in guessed)
        with torch.no_grad():
            logits = tiny_llm.model(torch.tensor([ids + canvas])).double()[0, len(ids):]
        probs = torch.softmax(logits, -1)  # confidence: the pick's probability under the whole distribution
        logits[:, mask] = float("-inf")  # the mask token is never a pick
        for p, token, conf in ev.provisional:
            assert token == int(logits[p].argmax())
            assert conf == pytest.approx(float(probs[p, token]), rel=1e-5)
            checked += 1
        if ev.provisional and ev.committed:  # low_confidence commits the most confident ones
            assert max(c for _, _, c in ev.provisional) <= min(ev.confidences) + 1e-6
        canvas = list(ev.canvas)
    assert checked > 0
    assert events[-1].provisional == ()  # the finished canvas has nothing provisional


def test_asking_changes_no_token_and_nothing_is_reported_unless_asked(tiny_llm):
    ids = tiny_llm.encode_prompt("Emma Woodhouse")
    plain, plain_events = run(tiny_llm, ids)
    asked, _ = run(tiny_llm, ids, provisional=True)
    assert plain.canvas == asked.canvas
    assert not any(e.provisional for e in plain_events)


@pytest.mark.parametrize("kv_cache", ["prefix", "dual"])
def test_cached_steps_report_the_block_left_masked(tiny_llm, kv_cache):
    ids = tiny_llm.encode_prompt("She was")
    mask = tiny_llm.tokenizer.mask_id
    _, events = run(tiny_llm, ids, provisional=True, kv_cache=kv_cache)
    canvas = [mask] * 16
    for ev in events:
        block = range(ev.block * 8, ev.block * 8 + 8)
        assert {p for p, _, _ in ev.provisional} == {p for p in block if canvas[p] == mask} - set(ev.committed)
        assert all(t != mask for _, t, _ in ev.provisional)
        canvas = list(ev.canvas)
    assert sum(len(e.provisional) for e in events) > 0


def test_a_block_model_reports_its_current_block(tmp_path):
    llm = LLM.load(write_sdar_checkpoint(tmp_path, seed=0),
                   EngineConfig(max_batch=4, max_prompt_tokens=64, max_gen_length=64))
    prompt = [88, 5, 640, 31, 77, 402, 15, 9, 12, 33]  # prefill steps first, then a block holding its tail
    b = 4
    _, events = run(llm, prompt, gen_length=12, steps=12, block_length=b, provisional=True)
    mask, P = llm.tokenizer.mask_id, len(prompt)
    canvas = [mask] * 12
    for ev in events:
        shown = [p for p, _, _ in ev.provisional] or list(ev.committed)
        if not shown:  # prefill, store, or a denoise step past the output's end
            continue
        block = (P + shown[0]) // b  # the block being decoded
        masked = {p for p in range(block * b - P, (block + 1) * b - P) if 0 <= p < 12 and canvas[p] == mask}
        assert set(ev.committed) <= masked
        assert {p for p, _, _ in ev.provisional} == masked - set(ev.committed)  # output positions only
        assert all(t != mask for _, t, _ in ev.provisional)
        canvas = list(ev.canvas)
    assert sum(len(e.provisional) for e in events) > 0


def test_the_simulated_runner_reports_the_rest_of_its_block(tiny_model_dir):
    llm = simulated_llm(tiny_model_dir, 0.0, max_batch=2)
    events = []
    llm.generate(["Emma"], SamplingParams(gen_length=16, steps=8, block_length=8, seed=0, provisional=True),
                 on_event=events.append)
    assert [len(e.provisional) for e in events] == [6, 4, 2, 0, 6, 4, 2, 0]
    assert all(c == 0.5 for e in events for _, _, c in e.provisional)


def test_provisional_must_be_a_boolean():
    with pytest.raises(InvalidRequest, match="provisional"):
        SamplingParams(provisional=1).validate()
