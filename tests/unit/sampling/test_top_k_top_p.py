"""top-k / top-p / min-p inside the batched sampler: per row, and what they keep."""

from __future__ import annotations

import pytest
import torch

from celeris.engine.errors import InvalidRequest
from celeris.engine.sampling.params import SamplingParams
from celeris.engine.sampling.select import filter_logits as _filter


def filter_logits(logits, top_k, top_p, min_p=None, temperature=None):
    B = logits.shape[0]
    zeros = torch.zeros(B, dtype=torch.float64)
    return _filter(logits, top_k, top_p, zeros if min_p is None else min_p,
                   torch.ones(B, dtype=torch.float64) if temperature is None else temperature)


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


def test_min_p_keeps_tokens_at_least_that_fraction_as_likely_as_the_top_one_at_the_temperature():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    logits = probs.log()[None, None].expand(4, 1, 4)
    off = torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.float64)
    min_p = torch.tensor([0.5, 0.29, 0.0, 0.5], dtype=torch.float64)
    out = filter_logits(logits, *off, min_p, torch.tensor([1.0, 1.0, 1.0, 0.5], dtype=torch.float64))
    assert torch.isfinite(out[0, 0]).tolist() == [True, True, False, False]  # 0.3 >= 0.5 * 0.5
    assert torch.isfinite(out[1, 0]).tolist() == [True, True, True, False]  # 0.15 >= 0.29 * 0.5
    assert torch.isfinite(out[2, 0]).all()  # 0: off
    # at temperature 0.5 the distribution sharpens to p^2: 0.09/0.25 = 0.36 < 0.5 drops the second
    assert torch.isfinite(out[3, 0]).tolist() == [True, False, False, False]


def test_min_p_1_sampling_is_greedy_and_bad_values_are_refused(tiny_llm):
    ids = tiny_llm.encode_prompt("It is a truth universally")
    base = dict(gen_length=16, steps=8, block_length=8, stop_at_eos=False, seed=5)
    greedy = tiny_llm.generate([ids], SamplingParams(**base))[0].token_ids
    assert tiny_llm.generate([ids], SamplingParams(**base, temperature=2.0, min_p=1.0))[0].token_ids == greedy
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(InvalidRequest, match="min_p"):
            SamplingParams(**base, min_p=bad).validate()


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


def test_without_top_p_a_partial_sort_keeps_the_same_tokens():
    """Dream folders filter every row with top_k 50: without top-p, only the top_k_max largest
    logits are sorted, and the kept set is the full sort's (ties at the k-th included)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 3, 500, generator=g).round(decimals=1)  # plenty of ties
    top_k = torch.tensor([50, 0, 1, 7])
    top_p = torch.ones(4, dtype=torch.float64)
    min_p = torch.tensor([0.0, 0.3, 0.0, 0.05], dtype=torch.float64)
    temperature = torch.tensor([1.0, 0.7, 1.0, 2.0], dtype=torch.float64)
    full = _filter(logits, top_k, top_p, min_p, temperature)
    partial = _filter(logits, top_k, top_p, min_p, temperature, nucleus=False, top_k_max=50)
    assert torch.equal(full, partial)
    assert torch.isfinite(partial[1]).sum() < 3 * 500  # min_p still filters the top_k-0 row
