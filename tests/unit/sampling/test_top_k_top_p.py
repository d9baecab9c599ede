"""top-k / top-p / min-p inside the batched sampler: per row, and what they keep."""

from __future__ import annotations

import pytest
import torch

from celeris.engine.errors import InvalidRequest
from celeris.engine.sampling.params import SamplingParams
from celeris.engine.sampling import filters
from celeris.engine.sampling.filters import Filters
from celeris.engine.sampling.select import filter_logits as _filter


def filter_logits(logits, top_k, top_p, min_p=None, temperature=None):
    B = logits.shape[0]
    zeros = torch.zeros(B, dtype=torch.float64)
    return _filter(logits, Filters(top_k, top_p, zeros if min_p is None else min_p,
                                   torch.ones(B, dtype=torch.float64) if temperature is None else temperature))


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
    knobs = Filters(top_k, top_p, min_p, temperature)
    full = _filter(logits, knobs)
    partial = _filter(logits, knobs, nucleus=False, top_k_max=50)
    assert torch.equal(full, partial)
    assert torch.isfinite(partial[1]).sum() < 3 * 500  # min_p still filters the top_k-0 row


# ---------------------------------------------------------------- the nucleus on the CPU: ranked prefixes

def _full_nucleus(rows: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The rule as one stable sort of every row ranks it (the GPU's way)."""
    order = torch.sort(rows, dim=-1, descending=True, stable=True).indices
    return filters._keep_ranked(rows, order, p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_nucleus_from_ranked_prefixes_keeps_what_the_full_sort_keeps(dtype):
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        n, V = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(2, 20_000, (1,), generator=g))
        rows = torch.randn(n, V, generator=g) * float(torch.rand(1, generator=g) * 6)
        hot = torch.randint(0, V, (n, 8), generator=g)  # a peaked head, as a trained model's
        rows = rows.scatter(-1, hot, torch.rand(n, 8, generator=g) * float(trial % 12) + 4)
        if trial % 3 == 0:
            rows = rows.round()  # ties everywhere
        if trial % 5 == 0:
            rows[:, ::7] = float("-inf")  # tokens a constraint forbids
        p = torch.rand(n, generator=g).clamp(0.01, 1.0)
        if trial % 4 == 0:
            p[0] = 1.0  # off
        rows = rows.to(dtype)
        assert torch.equal(filters._nucleus_prefix(rows, p), _full_nucleus(rows, p)), trial


def test_tied_tokens_at_the_nucleus_edge_are_kept_by_lower_token_id():
    V = 5000
    rows = torch.full((1, V), -10.0) + torch.randn(1, V, generator=torch.Generator().manual_seed(1)) * 0.1
    tied = torch.randperm(V, generator=torch.Generator().manual_seed(2))[:100]
    rows[0, tied] = 5.0  # 100 tokens of ~1% each, more than the first prefix holds
    keep = filters._nucleus_prefix(rows, torch.tensor([0.5]))
    expect = torch.zeros(V, dtype=torch.bool)
    expect[tied.sort().values[:51]] = True  # mass before rank 50 is ~0.4995 <= 0.5, before rank 51 > 0.5
    assert torch.equal(keep[0], expect)
    assert torch.equal(keep, _full_nucleus(rows, torch.tensor([0.5])))


def test_filtering_only_the_candidates_on_the_cpu_selects_what_filtering_every_position_does(monkeypatch):
    import celeris.engine.sampling.select as sampler
    from celeris.engine.sampling.batch import RowKnobs, SamplingBatch, SelectionRule, Window

    g = torch.Generator().manual_seed(3)
    B, W, V, mask = 3, 8, 3000, 5
    knobs = [dict(temperature=0.7, top_p=0.9, seed=1), dict(temperature=0.0, top_k=20), dict(temperature=1.0, top_p=0.5,
                                                                                            min_p=0.05, seed=2)]
    params = [SamplingParams(**{"gen_length": 8, "steps": 4, "block_length": 8, "stop_at_eos": False} | k) for k in knobs]
    batch = SamplingBatch.build([RowKnobs(p, 2, 3, frozenset()) for p in params], B, V, torch.device("cpu"))
    candidate = torch.rand(B, W, generator=g) < 0.5
    candidate[:, 0] = True
    pos = torch.arange(W).expand(B, W)
    window = Window(torch.full((B, W), mask), candidate, pos, pos)
    for rule in (SelectionRule(mask_id=mask), SelectionRule(mask_id=mask, conf_after_filter=True)):
        logits = torch.randn(B, W, V, generator=g) * 3
        only = sampler.select_tokens(logits.clone(), batch, window, rule)
        with monkeypatch.context() as m:
            m.setattr(sampler, "_filtered", lambda lg, b, w: sampler.filter_logits(
                lg, Filters(b.top_k, b.top_p, b.min_p, b.temperature), b.nucleus, b.top_k_max))
            every = sampler.select_tokens(logits.clone(), batch, window, rule)
        assert torch.equal(only.commit, every.commit) and torch.equal(only.n_commit, every.n_commit)
        assert torch.equal(only.x0[candidate], every.x0[candidate])
        assert torch.equal(only.conf[candidate], every.conf[candidate])


# ---------------------------------------------------------------- draws at the candidates, from the live tokens

def _dense_draw(rows, h, temperature, banned):
    """The whole row's noise, then the first maximum with `banned` at -inf (what a GPU computes)."""
    from celeris.engine.sampling.noise import _mix32, _uniform
    V = rows.shape[-1]
    u = _uniform(_mix32(h[:, None] ^ torch.arange(V)))
    scores = rows.double() - temperature.double()[:, None] * torch.log(-torch.log(u))
    scores[:, banned] = float("-inf")
    return sampler_first_argmax(scores)


def sampler_first_argmax(x):
    from celeris.engine.sampling.select import first_argmax
    return first_argmax(x)


def test_a_draw_from_the_live_tokens_only_is_the_whole_rows_draw():
    from celeris.engine.sampling.noise import sampled_argmax
    g = torch.Generator().manual_seed(4)
    for trial in range(40):
        n, V = 6, int(torch.randint(2, 3000, (1,), generator=g))
        rows = torch.randn(n, V, generator=g) * 3
        rows[0] = float("-inf")  # nothing to draw: token 0, as the dense argmax gives
        rows[1, torch.rand(V, generator=g) < 0.97] = float("-inf")  # a nucleus
        rows[2, int(torch.randint(0, V, (1,), generator=g))] = float("nan")  # a broken logit wins, first NaN
        rows[3, :] = float("-inf")
        rows[3, 0] = 1.0  # only the banned token is live
        rows[4, 1:] = rows[4, 1:].round()  # ties
        h = torch.randint(0, 2**32, (n,), generator=g)
        temperature = torch.tensor([1.0, 0.7, 1.0, 1.0, 0.0, 2.5], dtype=torch.float64)
        banned = 0 if trial % 2 else V - 1
        if trial % 2:
            rows[3, 0], rows[3, 1] = 1.0, float("-inf")
        live = rows != float("-inf")
        live[:, banned] = False
        assert torch.equal(sampled_argmax(rows, h, temperature, live), _dense_draw(rows, h, temperature, banned)), trial


@pytest.mark.parametrize("sparse_draw", [1, 10**9])  # the candidates' whole rows / only their live tokens
def test_sampling_on_the_cpu_draws_what_the_whole_window_draws(monkeypatch, sparse_draw):
    import celeris.engine.sampling.select as sampler
    from celeris.engine.sampling.batch import RowKnobs, SamplingBatch, SelectionRule, Window
    from celeris.engine.sampling.noise import gumbel_scores, uniform_noise

    g = torch.Generator().manual_seed(5)
    B, W, V, mask = 3, 8, 2000, 5
    knobs = [dict(temperature=0.7, top_p=0.9, seed=1), dict(temperature=1.3, seed=9), dict(temperature=1.0, top_k=30,
                                                                                           seed=2)]
    params = [SamplingParams(**{"gen_length": 8, "steps": 4, "block_length": 8, "stop_at_eos": False} | k) for k in knobs]
    batch = SamplingBatch.build([RowKnobs(p, 2, 3, frozenset()) for p in params], B, V, torch.device("cpu"))
    candidate = torch.rand(B, W, generator=g) < 0.6
    pos = torch.arange(W).expand(B, W) + 40
    window = Window(torch.full((B, W), mask), candidate, pos, pos)

    def dense(pick, b, w, mask_id):
        u = uniform_noise(b.seed, b.step, w.noise_pos, pick.shape[-1], 0)
        return sampler._argmax_but(gumbel_scores(pick, b.temperature, u), mask_id, None, in_place=True)

    monkeypatch.setattr(sampler, "SPARSE_DRAW", sparse_draw)
    for rule in (SelectionRule(mask_id=mask), SelectionRule(mask_id=mask, conf_after_filter=True)):
        logits = torch.randn(B, W, V, generator=g) * 2
        logits[..., mask] = 50.0  # the model's favourite is the mask token: never drawn
        sparse = sampler.select_tokens(logits.clone(), batch, window, rule)
        with monkeypatch.context() as m:
            m.setattr(sampler, "_drawn", dense)
            whole = sampler.select_tokens(logits.clone(), batch, window, rule)
        assert torch.equal(sparse.x0[candidate], whole.x0[candidate])
        assert not (sparse.x0[candidate] == mask).any()
        assert torch.equal(sparse.commit, whole.commit) and torch.equal(sparse.conf[candidate], whole.conf[candidate])
