"""A request's failure is its own (issue 40, item 1): whatever belongs to one row of a step (its
structure's masks and commits, its stop strings, non-finite logits in its row, building its event)
ends that request alone with its own typed error, and every other row of the batch decodes
token-identically to a run without it, on both runners (celeris-tiny: full canvas,
celeris-tiny-block: block diffusion). No error carries another request's input."""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import Callable

import llguidance
import pytest

from celeris.engine.errors import InvalidRequest, RowFailed
from celeris.engine.llm import EMBEDDED_MODELS, LLM
from celeris.engine.requests import Request
from celeris.engine.loop.sequence import Sequence
from celeris.engine.structured.constraint import Constraint, Structured
from tests.helpers import stream_beside

PROMPTS = ["It was a bright", "Secret-prompt-alpha", "Once upon", "Secret-prompt-beta"]
FIELD = "structured_outputs.regex"


@pytest.fixture(scope="module", params=["celeris-tiny", "celeris-tiny-block"])
def llm(request) -> LLM:
    return LLM.load(EMBEDDED_MODELS[request.param])


def _params(llm: LLM, seed: int):
    return replace(llm.defaults, gen_length=32, steps=32, block_length=16, temperature=1.0, seed=seed)


def _others(llm: LLM) -> list[Sequence]:
    """The well-behaved requests: free text and a structured one, each with its own seed."""
    seqs = [llm.build(Request(prompt=p, params=_params(llm, k), request_id=f"ok-{k}")) for k, p in enumerate(PROMPTS)]
    seqs.append(llm.build(Request(prompt="Mail:", params=_params(llm, 9), request_id="ok-mail",
                                  structured=Structured("regex", "[a-z]{1,6}@[a-z]{2,4}", FIELD))))
    return seqs


def _bad(llm: LLM) -> Sequence:
    return llm.build(Request(prompt="Bad-request-own-prompt", params=_params(llm, 5), request_id="bad",
                             structured=Structured("regex", "[a-z]{1,3}", FIELD)))


def _empty_language(llm: LLM, seq: Sequence) -> None:
    """What a compile-time check could miss: the slot's grammar swapped for an empty language
    (today's compiler refuses `[^\\s\\S]` itself; tests/unit/structured/test_structured_limits.py)."""
    comp = llm.requests._compiler
    layout = seq.constraint.layout
    empty = llguidance.LLMatcher.grammar_from_regex(r"[^\s\S]")
    slots = (dataclasses.replace(layout.slots[0], grammar=empty),)
    seq.constraint = Constraint(dataclasses.replace(layout, slots=slots), comp, FIELD)


def _commit_breaks(llm: LLM, seq: Sequence) -> None:
    def commit(pos: int, token: int) -> None:
        raise RuntimeError("matcher exploded: Bad-request-own-prompt")
    seq.constraint.commit = commit


def _stop_check_breaks(llm: LLM, seq: Sequence) -> None:
    seq.find_stop_text = lambda ids: 1 // 0


def _nan_row(llm: LLM, seq: Sequence) -> None:
    seq.request_id = "nan-row"  # the patched selection below writes NaN into this row's logits


INJECTIONS: dict[str, tuple[Callable[[LLM, Sequence], None], type, str]] = {
    "empty language": (_empty_language, InvalidRequest, FIELD),
    "commit raises": (_commit_breaks, RowFailed, "RuntimeError"),  # its text is not echoed, its type is
    "stop check raises": (_stop_check_breaks, RowFailed, "ZeroDivisionError"),
    "NaN logits": (_nan_row, RowFailed, "not finite"),
}


@pytest.fixture
def nan_selection(llm, monkeypatch):
    """Both runners' selection, with NaN written into the logits of the row named `nan-row`."""
    runner = llm.runner
    select = type(runner)._select

    def poisoned(self, *args, **kwargs):
        rows = args[0] if isinstance(args[0], list) else args[0].group  # BlockRunner's rows, Runner's Packed
        logits = args[1]
        for i, s in enumerate(rows):
            if s.request_id == "nan-row":
                logits[i] = float("nan")
        return select(self, *args, **kwargs)
    monkeypatch.setattr(type(runner), "_select", poisoned)


@pytest.mark.parametrize("shape", list(INJECTIONS))
def test_one_rows_failure_ends_it_alone_and_the_batch_is_unchanged(llm, shape, nan_selection):
    inject, error_type, named = INJECTIONS[shape]
    if shape == "stop check raises":  # a stop string is looked for when a block ends: free text
        bad = llm.build(Request(prompt="Bad-request-own-prompt", params=replace(_params(llm, 5), stop=("zz",)),
                                request_id="bad"))
    else:
        bad = _bad(llm)
    inject(llm, bad)
    alone = llm.run(_others(llm))
    mixed = llm.run(_others(llm)[:2] + [bad] + _others(llm)[2:])
    failed = mixed.pop(2)
    assert [r.token_ids for r in mixed] == [r.token_ids for r in alone]  # token-identical without it
    assert all(r.error is None for r in mixed)
    assert isinstance(failed.error, error_type)
    text = str(failed.error)
    assert named in text or named in [getattr(v, "field", None) for v in getattr(failed.error, "violations", [])]
    assert not any(p in text for p in PROMPTS + ["Mail:"])  # nothing of another request's input
    assert llm.loop.idle and sorted(llm.loop.free_slots) == list(range(llm.runner.slots))


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_a_failed_row_streams_its_own_error_and_the_others_finish(llm):
    """Through the asyncio scheduler: the failed request's stream raises its error; the rest end
    normally with the tokens of a run without it."""
    alone = [r.token_ids for r in llm.run(_others(llm))]
    bad = _bad(llm)
    _empty_language(llm, bad)
    out = stream_beside(llm, _others(llm)[:2] + [bad] + _others(llm)[2:], timeout_s=120)
    error = out.pop(2)
    assert isinstance(error, InvalidRequest) and error.violations[0].field == FIELD
    assert [list(g) for g in out] == alone


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_rows_with_a_nan_or_plus_inf_at_a_real_column_are_found_in_every_dtype(dtype):
    """`nonfinite_rows`: a NaN or +inf at a real column fails its row; -inf (ids a model never
    emits), large ordinary logits (a float16 row summing past 65,504) and padding columns do not."""
    import torch

    from celeris.engine.families.selection import nonfinite_rows

    B, W, V = 6, 3, 4096
    logits = torch.randn(B, W, V, generator=torch.Generator().manual_seed(0)).to(getattr(torch, dtype))
    logits[0, 1, 7] = float("nan")
    logits[1, 2, 9] = float("inf")
    logits[2, 0, :100] = float("-inf")
    logits[3] = 30.0  # 4,096 x 30 = 122,880: past float16's range as a sum
    logits[4, 2, 5] = float("nan")  # at a padding column
    logits[5, 0, 1], logits[5, 0, 2] = float("inf"), float("-inf")  # sums to NaN
    real = torch.ones(B, W, dtype=torch.bool)
    real[4, 2] = False
    assert nonfinite_rows(logits, real).tolist() == [True, True, False, False, False, True]
