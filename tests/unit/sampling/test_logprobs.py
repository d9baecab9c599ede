"""Log-probabilities of committed tokens, taken at the step each was committed."""

from __future__ import annotations

import math

import pytest
import torch

from celeris.engine.sampling.params import SamplingParams


def run(llm, ids, **kw):
    seq = llm.sequence(ids, SamplingParams(gen_length=16, steps=8, block_length=8, seed=0, stop_at_eos=False, **kw))
    llm.loop.add(seq)
    events = []
    llm.loop.run_to_completion(events.append)
    return seq, events


def test_each_committed_token_carries_its_logprob_and_alternatives(tiny_llm):
    ids = tiny_llm.encode_prompt("It is a truth universally")
    seq, events = run(tiny_llm, ids, logprobs=3)
    first = events[0]
    assert len(first.committed_logprobs) == len(first.committed) > 0
    # The first step is one full forward over prompt + masks: its distribution is checkable.
    x = torch.tensor([ids + [tiny_llm.tokenizer.mask_id] * 16])
    logp = torch.log_softmax(tiny_llm.model(x).float(), -1)[0, len(ids):]
    for pos, (lp, top) in zip(first.committed, first.committed_logprobs):
        assert lp == pytest.approx(logp[pos, seq.canvas[pos]].item(), abs=1e-5)
        assert [i for i, _ in top] == logp[pos].topk(3).indices.tolist()
        assert top[0][0] == seq.canvas[pos]  # greedy: the committed token is the most likely one
    last = events[-1]
    assert len(last.logprobs) == len(last.generated) == 16
    assert all(lp <= 0 and len(top) == 3 for lp, top in last.logprobs)
    assert not any(e.logprobs for e in events[:-1])  # the full list only on the last event


def test_no_logprobs_unless_asked_and_the_output_is_the_same(tiny_llm):
    ids = tiny_llm.encode_prompt("It is a truth universally")
    plain, events = run(tiny_llm, ids)
    asked, _ = run(tiny_llm, ids, logprobs=0)
    assert plain.canvas == asked.canvas
    assert not any(e.committed_logprobs or e.logprobs for e in events)
    assert all(top == () and math.isfinite(lp) for lp, top in asked.token_logprobs.values())


def test_logprobs_limit():
    from celeris.engine.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="logprobs"):
        SamplingParams(logprobs=21).validate()
