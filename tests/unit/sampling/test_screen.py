"""Screened confidences (engine/sampling/screen.py): on 16-bit and float32 logits on the CPU, only the
candidates that can commit get the float64 softmax, and the step commits the same positions and
tokens, reporting the same confidences bit for bit, as with the softmax at every candidate;
ties at the cut keep the published loops' torch.topk order."""

from __future__ import annotations

import pytest
import torch

import celeris.engine.sampling.select as sampler
from celeris.engine.sampling.batch import RowKnobs, SamplingBatch, SelectionRule, Window
from celeris.engine.sampling.params import SamplingParams
from celeris.engine.sampling.screen import REL, estimates, quick
from celeris.engine.sampling.select import first_argmax, published_order, select_tokens

MASK = 5
NAN, INF = float("nan"), float("inf")


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"gen_length": 32, "steps": 32, "block_length": 32, "seed": 0, "stop_at_eos": False} | kw)


def _step(logits, rows, candidate, screened: bool, monkeypatch):
    """select_tokens + published_order over (B, W, V) logits; rows: (params, k) per real row."""
    B, W, V = logits.shape
    batch = SamplingBatch.build([RowKnobs(p, k, 3, frozenset()) for p, k in rows], B, V, torch.device("cpu"))
    pos = torch.arange(W).expand(B, W)
    window = Window(torch.full((B, W), MASK), candidate, pos, pos)
    rule = SelectionRule(mask_id=MASK)
    computed = []
    measures = sampler._measures

    def counted(lg, *a):
        computed.append(lg.shape[0] * lg.shape[1])
        return measures(lg, *a)

    with monkeypatch.context() as m:
        m.setattr(sampler, "_measures", counted)
        if not screened:
            m.setattr(sampler, "screening", lambda *a: None)
        sel = select_tokens(logits, batch, window, rule)
        sel = published_order(sel, candidate, batch, rule, [(W + 3, 3)] * B)
    return sel, sum(computed)


def _same(logits, rows, candidate, monkeypatch, provisional=()):
    fast, n_fast = _step(logits, rows, candidate, True, monkeypatch)
    full, n_full = _step(logits, rows, candidate, False, monkeypatch)
    assert torch.equal(fast.commit, full.commit)
    assert torch.equal(fast.n_commit, full.n_commit)
    assert torch.equal(fast.x0[candidate], full.x0[candidate])
    c = fast.commit
    assert torch.equal(fast.conf[c].view(torch.int64), full.conf[c].view(torch.int64))  # bit for bit
    for r in provisional:  # rows reporting every candidate's confidence
        assert torch.equal(fast.conf[r][candidate[r]].view(torch.int64), full.conf[r][candidate[r]].view(torch.int64))
    return n_fast, n_full


def _logits(kind: str, B: int, W: int, V: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "flat":  # a random model: every p(x0) within ~1e-4 of the others
        return (0.32 * torch.randn(B, W, V, generator=g)).to(dtype)
    if kind == "peaked":
        return (4 * torch.randn(B, W, V, generator=g)).to(dtype)
    x = torch.randint(-2, 3, (B, W, V), generator=g).to(dtype)  # "ties": equal rows and values
    x[:, 1::3] = x[:, 0:1]  # every third position a copy of the first: exact float64 ties
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["flat", "peaked", "ties"])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("sampled", [True, False])
def test_screened_steps_commit_and_report_what_the_full_softmax_does(kind, seed, dtype, sampled, monkeypatch):
    """A batch with a sampled row draws its picks apart (`select._drawn`); an all-greedy one takes
    picks and estimates from one copy of the candidates' rows (`screen.picked`)."""
    B, W, V = 4, 16, 3001
    logits = _logits(kind, B, W, V, seed, dtype)
    g = torch.Generator().manual_seed(100 + seed)
    candidate = torch.rand(B, W, generator=g) < 0.7
    candidate[:, 0] = candidate[:, 1] = candidate[:, 4] = True
    rows = [(_params(), 1 + seed), (_params(threshold=0.0004 if kind == "flat" else 0.3), 1),
            (_params(temperature=0.8, seed=seed) if sampled else _params(), 2)]  # row 3 pads the bucket
    n_fast, n_full = _same(logits, rows, candidate, monkeypatch)
    if kind != "ties":
        assert n_fast < n_full  # the point: fewer float64 softmaxes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_unscreened_rows_and_hard_positions_keep_their_published_values(dtype, monkeypatch):
    B, W, V = 4, 12, 2048
    logits = _logits("peaked", B, W, V, 7, dtype)
    logits[0, 2] = -INF  # no finite logit: a NaN confidence
    logits[0, 3, MASK] = 60  # the mask id's logit tops the row: never the pick
    logits[1, 4] += 11000 if dtype == torch.float16 else 600  # beyond the exp table's range (or near its edge)
    logits[1, 6, 9] = INF if dtype == torch.float32 else logits[1, 6, 9]  # float32: an infinite logit
    logits[1, 5, 7] = NAN
    logits[2, :, 100:] = -INF  # a constrained vocabulary
    candidate = torch.ones(B, W, dtype=torch.bool)
    rows = [(_params(), 2), (_params(), 3), (_params(provisional=True), 2), (_params(factor=1.0), 1)]
    _same(logits, rows, candidate, monkeypatch, provisional=(2,))
    rows = [(_params(remasking="margin"), 2), (_params(remasking="random", seed=3), 1), (_params(), 12), (_params(), 0)]
    _same(logits, rows, candidate, monkeypatch)


def test_ties_at_the_cut_take_the_published_topk_order(monkeypatch):
    """Three copies of the most confident row with k = 2: which two commit is torch.topk's choice
    over the whole ranked array; screening must not change the other values it walks."""
    B, W, V = 2, 24, 4096
    logits = _logits("flat", B, W, V, 11)
    for w in (3, 9, 17):
        logits[:, w] = logits[0, 0]
        logits[:, w, 0] = 5.0
    candidate = torch.ones(B, W, dtype=torch.bool)
    for k in (1, 2, 3, 4):
        _same(logits, [(_params(), k), (_params(threshold=0.99), 1)], candidate, monkeypatch)


@pytest.mark.parametrize("shift", [0.0, -300.0, 450.0])
def test_estimates_are_within_rel_of_the_published_softmax(shift):
    g = torch.Generator().manual_seed(1)
    rows = torch.cat([0.32 * torch.randn(8, 126_464 // 8, generator=g), 6 * torch.randn(8, 126_464 // 8, generator=g)])
    rows = (rows + shift).to(torch.bfloat16)
    rows[3, 100:] = -INF
    x0 = torch.cat([rows[:12].float().argmax(-1), torch.randint(0, rows.shape[1], (4,), generator=g)])
    est = estimates(rows, x0)
    exact = torch.softmax(rows.double(), -1).gather(1, x0[:, None]).squeeze(1)
    ok = est.isfinite()
    assert ok[:12].all()
    assert ((est[ok] - exact[ok]).abs() <= exact[ok] * REL / 30).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("V", [4096, 126_464])
def test_quick_estimates_are_within_half_their_bound_of_the_published_softmax(V, dtype):
    """`quick`'s bound claims a margin of 2x over the float32 estimate's error (measured ~1e-8
    against a bound of ~5e-6 at the maximum); on flat rows (a random model), peaked ones, shifted
    ones (their maximum subtracted first), a constrained row and draws far from the maximum (those
    within 69 of it are estimated, the others left to the published value); rows with a NaN or
    +inf are not estimated."""
    g = torch.Generator().manual_seed(3)
    big = 200.0 if dtype == torch.float16 else 500.0  # float16 ends at 65504
    rows = torch.cat([0.32 * torch.randn(6, V, generator=g), 6 * torch.randn(6, V, generator=g),
                      4 * torch.randn(4, V, generator=g) + big * 0.6, 4 * torch.randn(4, V, generator=g) - big])
    rows[3, 100:] = -INF
    rows[14, 7] = NAN
    rows[15, 9] = INF
    rows = rows.to(dtype)
    x0 = torch.cat([rows[:12].float().argmax(-1), torch.randint(0, V, (8,), generator=g)])
    before = rows.clone()
    est, bound = quick(rows, x0)
    assert torch.equal(rows.view(torch.int8), before.view(torch.int8))  # the caller's logits are untouched
    exact = torch.softmax(rows.double(), -1).gather(1, x0[:, None]).squeeze(1)
    ok = est.isfinite()
    assert ok[:12].all() and not ok[14] and not ok[15]
    assert ((est[ok] - exact[ok]).abs() <= exact[ok] * bound[ok] / 2).all()
    assert (bound[:12] < 1e-5).all()  # at the maximum, well under the ~2e-5 of a logit 69 below it
    far = rows.float().gather(1, x0[:, None]).squeeze(1) < rows.float().amax(-1) - 70
    assert far.any() and not (ok & far).any()


def test_candidates_closer_than_the_quick_bound_are_told_apart_by_the_table(monkeypatch):
    """16 candidates whose p(x0) differ by ~1e-7 (each its own change of a few ulps to a logit far below
    the maximum): the float32 estimate cannot rank them, the table can, so one float64 softmax
    decides the step instead of 16, and the commit is the full softmax's."""
    B, W, V = 1, 16, 4096
    g = torch.Generator().manual_seed(5)
    base = (2 * torch.randn(V, generator=g)).to(torch.bfloat16)
    logits = base.expand(B, W, V).clone()
    low = base.float().argsort()[V // 2:V // 2 + W]  # logits near the median: e^(l - max) ~ e^-6
    bits = logits.view(torch.int16)
    for w in range(W):
        bits[0, w, low[w]] += w + 1  # w + 1 bfloat16 ulps
    candidate = torch.ones(B, W, dtype=torch.bool)
    x0 = logits.view(W, V).float().argmax(-1)
    est, bound = quick(logits.view(W, V), x0)
    exact = torch.softmax(logits.view(W, V).double(), -1).gather(1, x0[:, None])
    assert exact.unique().numel() == W  # all different,
    assert (exact.max() - exact.min()) / exact.max() < bound.min() / 10  # but closer than quick can tell
    assert est.isfinite().all()
    n_fast, n_full = _same(logits, [(_params(), 1)], candidate, monkeypatch)
    assert n_full == W and n_fast <= 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("passes", [1, 3])
@pytest.mark.parametrize("sliced", [False, True])
@pytest.mark.parametrize("by_runs", [False, True])
def test_picked_gives_the_greedy_pick_and_quicks_estimate_bit_for_bit(dtype, passes, sliced, by_runs, monkeypatch):
    """`picked` (one float32 copy of each candidate row for the argmax and the estimate) returns
    what `_argmax_but` and `quick` give apart: the first maximum with the mask id excluded (a row
    whose maximum, or NaN, is the mask id; ties; a NaN row; a row with nothing finite but the mask
    id), the same estimates and bounds bit for bit (shifted rows too), whatever the rows per pass,
    from a contiguous window or one sliced out of longer logits, widened run by run or gathered."""
    import celeris.engine.sampling.screen as screen_mod

    g = torch.Generator().manual_seed(9)
    B, W, V = 2, 8, 4099  # V not a multiple of the run length: a tail
    big = 200.0 if dtype == torch.float16 else 500.0
    x = torch.cat([2 * torch.randn(1, W, V, generator=g), 4 * torch.randn(1, W, V, generator=g) + big])
    x[0, 0, MASK] = 90  # the mask id is the maximum
    x[0, 1, MASK] = NAN  # a NaN at the mask id only
    x[0, 2, 17] = x[0, 2, 3000] = 95  # tied maxima: the first
    x[0, 3, 40] = NAN  # a NaN row
    x[0, 4] = -INF
    x[0, 4, MASK] = 0.0  # nothing finite but the mask id
    x[1, 5] -= 2 * big  # shifted the other way
    x = x.to(dtype)
    if sliced:  # positions 3..3+W of a longer canvas: no (B * W, V) view
        x = torch.cat([torch.randn(B, 3, V, generator=g).to(dtype), x, torch.randn(B, 2, V, generator=g).to(dtype)], 1)
        x = x[:, 3:3 + W]
    flat = torch.tensor([0, 1, 2, 3, 4, 6, 7, 9, 12, 13, 15])  # candidates of both rows
    monkeypatch.setattr(screen_mod, "_QUICK_CHUNK", max(1, flat.numel() // passes) * V)
    monkeypatch.setattr(screen_mod, "_RUN_COPY_MIN", 0 if by_runs else 1 << 30)  # 16-bit rows copied run by run
    before = x.clone()
    picks, est, bound = screen_mod.picked(x, flat, MASK)
    assert torch.equal(x.view(torch.int8), before.view(torch.int8))  # the caller's logits are untouched
    want = sampler._argmax_but(x, MASK, None, in_place=False).reshape(-1)[flat]
    assert torch.equal(picks, want)
    ref_est, ref_bound = quick(x.reshape(B * W, V)[flat], want)
    assert torch.equal(est.isnan(), ref_est.isnan()) and est.isfinite().sum() >= 6
    ok = est.isfinite()
    assert torch.equal(est[ok].view(torch.int64), ref_est[ok].view(torch.int64))
    assert torch.equal(bound.view(torch.int64), ref_bound.view(torch.int64))


def test_argmax_without_the_mask_id_reads_the_logits_without_copying(monkeypatch):
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-3, 4, (3, 6, 1537), generator=g).to(torch.bfloat16)
    x[0, 0, MASK] = 9  # the mask id is the maximum
    x[0, 1, MASK] = NAN  # a NaN at the mask id only
    x[0, 2, MASK], x[0, 2, 900] = NAN, NAN  # and a later NaN
    x[1, 0] = -INF
    x[1, 0, MASK] = 0.0  # nothing else finite
    before = x.clone()
    ref = x.clone()
    ref[..., MASK] = -INF
    assert torch.equal(sampler._argmax_but(x, MASK, None, in_place=False), first_argmax(ref))
    assert torch.equal(x.view(torch.int16), before.view(torch.int16))  # untouched


def test_rows_tied_at_their_cut_are_computed_whole():
    """Which of equal values torch.topk returns depends on every value it walks, so a row whose
    published values tie at its cut (or hold a NaN) gets every candidate's published value."""
    from celeris.engine.sampling.screen import Screen, tied
    conf = torch.tensor([[0.5, 0.5, 0.1, 0.0], [0.5, 0.5, 0.4, 0.0], [0.5, 0.4, 0.4, 0.0], [NAN, 0.2, 0.1, 0.0]],
                        dtype=torch.float64)
    exact = torch.tensor([[True, True, False, False], [True, True, True, False], [True, True, True, False],
                          [True, True, False, False]])
    screen = Screen(need=(1, 2, 2, 1), threshold=(0.0,) * 4)
    assert tied(conf, exact, screen).tolist() == [True, False, True, True]
    assert tied(conf, exact, Screen(need=(-1, 3, 1, -1), threshold=(0.0,) * 4)).tolist() == [False, False, False, False]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("params", [dict(), dict(threshold=0.2), dict(temperature=0.7, seed=3)])
def test_whole_decodes_are_the_same_screened_or_not(params, dtype, monkeypatch):
    """celeris-tiny in bfloat16 and float32 on the CPU, a batch of 3: every committed token and its
    step are those of the unscreened softmax (a random-ish trained model's peaked and flat rows alike)."""
    from celeris.engine.config import EngineConfig
    from celeris.engine.llm import LLM

    screens = []
    real = sampler.screening

    def decode(screened: bool):
        llm = LLM.load(None, EngineConfig(dtype=dtype, max_batch=4))
        with monkeypatch.context() as m:
            m.setattr(sampler, "screening", lambda *a: screens.append(real(*a)) or screens[-1] if screened else None)
            p = SamplingParams(**{"gen_length": 32, "steps": 16, "block_length": 8, "seed": 0} | params)
            outs = llm.generate(["Once upon a time", "The capital of France is", "1, 2, 3,"], p)
        return [(o.token_ids, o.steps, o.finish_reason) for o in outs]

    assert decode(True) == decode(False)
    assert any(s is not None for s in screens)  # the screened decode did screen
