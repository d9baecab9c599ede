"""top-k / top-p inside the batched sampler: per row, and what they keep."""

from __future__ import annotations

import pytest
import torch

from celeris.engine.errors import InvalidRequest
from celeris.engine.params import SamplingParams
from celeris.engine.sampler import filter_logits


def test_top_k_keeps_the_k_largest_and_their_ties():
    logits = torch.tensor([[[3.0, 1.0, 2.0, 2.0, 0.0]], [[3.0, 1.0, 2.0, 2.0, 0.0]]])
    out = filter_logits(logits, torch.tensor([2, 0]), torch.tensor([1.0, 1.0], dtype=torch.float64))
    assert torch.isfinite(out[0, 0]).tolist() == [True, False, True, True, False]  # 2nd largest is tied
    assert torch.isfinite(out[1, 0]).all()  # top_k 0: off


def test_top_p_keeps_the_nucleus_and_always_the_top_token():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None, None].expand(3, 1, 4)
    out = filter_logits(logits, torch.zeros(3, dtype=torch.long), torch.tensor([0.7, 0.1, 1.0], dtype=torch.float64))
    assert torch.isfinite(out[0, 0]).tolist() == [True, True, False, False]  # 0.5 + 0.3 >= 0.7
    assert torch.isfinite(out[1, 0]).tolist() == [True, False, False, False]
    assert torch.isfinite(out[2, 0]).all()


def test_top_k_1_sampling_is_greedy_and_rows_keep_their_own_settings(tiny_llm):
    ids = tiny_llm.encode_prompt("It is a truth universally")
    base = dict(gen_length=16, steps=8, block_length=8, stop_at_eos=False, seed=5)
    greedy = tiny_llm.generate([ids], SamplingParams(**base))[0].token_ids
    hot = SamplingParams(**base, temperature=2.0)
    k1 = SamplingParams(**base, temperature=2.0, top_k=1)
    seqs = [tiny_llm.sequence(ids, p) for p in (hot, k1)]
    for s in seqs:
        tiny_llm.loop.add(s)
    tiny_llm.loop.run_to_completion()
    assert seqs[1].canvas == greedy  # one token left to draw: the argmax, ranked by its real confidence
    alone = tiny_llm.generate([ids], hot)[0].token_ids
    assert seqs[0].canvas == alone != greedy  # the unfiltered row beside it is untouched


@pytest.mark.parametrize("kw", [dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=1.5)])
def test_bad_values_are_refused(kw):
    with pytest.raises(InvalidRequest, match=next(iter(kw))):
        SamplingParams(**kw).validate()
