"""Selection's vocabulary-sized work on the CPU: `first_argmax` and the candidate-only
confidences give exactly what `argmax` and the whole-window float64 softmax give."""

from __future__ import annotations

import pytest
import torch

from celeris.engine.sampling.select import Measure, confidences, first_argmax
from celeris.engine.sampling.batch import REMASK_CODE

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("V", [7, 512, 1000, 1537, 126_464 // 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_first_argmax_is_argmax(V, dtype):
    g = torch.Generator().manual_seed(V)
    x = torch.randint(-3, 4, (3, 5, V), generator=g).to(dtype)  # many ties: the first maximum wins
    x[0, 0] = -INF  # all -inf: index 0
    x[0, 1, V // 2] = NAN  # a NaN wins wherever it is
    x[0, 2, -1] = NAN  # in the tail
    x[0, 3, -1], x[0, 3, 1] = NAN, NAN  # the first NaN
    x[1, 0, -1] = 10.0  # the maximum in the tail
    x[1, 1, 0] = 10.0  # at the very start
    assert torch.equal(first_argmax(x), x.argmax(-1))
    assert torch.equal(first_argmax(x[:, 1:3]), x[:, 1:3].argmax(-1))  # a non-contiguous view


def test_first_argmax_empty_batch():
    x = torch.zeros(0, 4, 1000)
    assert first_argmax(x).shape == (0, 4)


@pytest.mark.parametrize("measures", [frozenset({"low_confidence"}), frozenset({"low_confidence", "margin", "random"}),
                                      None])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_candidate_confidences_are_bitwise_the_whole_window(measures, dtype):
    g = torch.Generator().manual_seed(0)
    B, W, V = 3, 8, 3000
    logits = (4 * torch.randn(B, W, V, generator=g)).to(torch.bfloat16)
    x0 = logits.argmax(-1)
    where = torch.rand(B, W, generator=g) < 0.5
    where[2] = False  # a row without candidates
    remask = torch.tensor([REMASK_CODE["low_confidence"], REMASK_CODE["margin"], REMASK_CODE["random"]])
    u = torch.rand(B, W, generator=g, dtype=torch.float64)
    measure = Measure(remask, u, dtype, measures)
    whole = confidences(logits, x0, measure)
    some = confidences(logits, x0, measure, where)
    assert some.dtype == whole.dtype and some.shape == whole.shape
    assert torch.equal(some[where], whole[where])  # bit for bit where it is read
    none = confidences(logits, x0, measure, torch.zeros(B, W, dtype=torch.bool))
    assert none.shape == (B, W)
