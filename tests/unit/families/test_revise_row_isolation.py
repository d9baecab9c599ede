"""A DiffusionGemma request's failure is its own (issue 40, item 1, the revise family): whatever
belongs to one row of a step (its structure's masks and commits, non-finite logits in its row, its
advance, its stop strings) ends that request alone with its own typed error, its slot's state is
dropped, and every other row of the batch decodes token-identically to a run without it. No error
carries another request's input, nor the failing exception's own text (only its type).

A tiny random DiffusionGemma checkpoint written by transformers' classes, with celeris-tiny's
byte-level BPE tokenizer (for structured outputs), CPU, float32, one thread.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import Callable

import pytest

pytest.importorskip("transformers")
llguidance = pytest.importorskip("llguidance")

import torch  # noqa: E402

from celeris.engine.config import EngineConfig  # noqa: E402
from celeris.engine.errors import InvalidRequest, RowFailed  # noqa: E402
from celeris.engine.llm import LLM  # noqa: E402
from celeris.engine.requests import Request  # noqa: E402
from celeris.engine.families.revise.slots import SlotState  # noqa: E402
from celeris.engine.loop.sequence import Sequence  # noqa: E402
from celeris.engine.structured.constraint import Constraint, Structured  # noqa: E402
from tests.helpers import stream_beside  # noqa: E402
from tests.unit.revise_references.gemma_checkpoint import write_bpe_checkpoint  # noqa: E402

CANVAS = 16
PROMPTS = ["It was a bright", "Secret-prompt-alpha", "Once upon", "Secret-prompt-beta"]
MAIL_PROMPT, MAIL = "Mail:", r"[a-z]{1,6}@[a-z]{2,4}"
FIELD = "structured_outputs.regex"
BAD_PROMPT, BAD_SEED = "Bad-request-own-prompt", 55
SECRET = "exception-text-Secret-prompt-alpha"  # what the injected exceptions say: never echoed


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    folder = write_bpe_checkpoint(tmp_path_factory.mktemp("dg-isolation"), canvas_length=CANVAS)
    yield LLM.load(folder, EngineConfig(max_batch=8, max_queue=16, max_prompt_tokens=64, max_gen_length=64))
    torch.set_num_threads(threads)


def _params(llm: LLM, seed: int, gen_length: int = 2 * CANVAS, **kw):
    return replace(llm.defaults, gen_length=gen_length, block_length=gen_length, steps=1, seed=seed,
                   max_denoising_steps=3, **kw)


def _others(llm: LLM) -> list[Sequence]:
    """The well-behaved requests: four free-text ones (two canvases each) and a structured one."""
    seqs = [llm.build(Request(prompt=p, params=_params(llm, k, ignore_eos=True), request_id=f"ok-{k}"))
            for k, p in enumerate(PROMPTS)]
    seqs.append(llm.build(Request(prompt=MAIL_PROMPT, params=_params(llm, 9), request_id="ok-mail",
                                  structured=Structured("regex", MAIL, FIELD))))
    return seqs


def _bad(llm: LLM, structured: bool = True) -> Sequence:
    spec = Structured("regex", "[a-z]{1,3}", FIELD) if structured else None
    return llm.build(Request(prompt=BAD_PROMPT, params=_params(llm, BAD_SEED, CANVAS, ignore_eos=not structured),
                             request_id="bad", structured=spec))


def _empty_language(llm: LLM, seq: Sequence, monkeypatch) -> None:
    """What a compile-time check could miss: the slot's grammar swapped for an empty language, so
    its mask allows nothing when the canvas commits."""
    layout = seq.constraint.layout
    empty = llguidance.LLMatcher.grammar_from_regex(r"[^\s\S]")
    slots = (dataclasses.replace(layout.slots[0], grammar=empty),)
    seq.constraint = Constraint(dataclasses.replace(layout, slots=slots), llm.requests._compiler, FIELD)


def _mask_raises(llm: LLM, seq: Sequence, monkeypatch) -> None:
    def fill(pos, words):
        raise RuntimeError(SECRET)
    seq.constraint.fill = fill


def _commit_raises(llm: LLM, seq: Sequence, monkeypatch) -> None:
    def commit(pos, token):
        raise RuntimeError(SECRET)
    seq.constraint.commit = commit


def _poisoned_logits(value: float):
    def inject(llm: LLM, seq: Sequence, monkeypatch) -> None:
        """One position of the bad row's logits set to `value` as the step hands them to the row
        (the forward is shared: each row's logits are made from it, then drawn from)."""
        draw = SlotState.draw

        def poisoned(self, logits):
            if self.seed == BAD_SEED:
                logits[3, 7] = value
            return draw(self, logits)
        monkeypatch.setattr(SlotState, "draw", poisoned)
    return inject


def _advance_raises(llm: LLM, seq: Sequence, monkeypatch) -> None:
    draw = SlotState.draw  # a row's step: its device part (`settle` is its host part)

    def failing(self, logits):
        if self.seed == BAD_SEED and self.steps == 1:  # its second step: mid-canvas
            raise KeyError(SECRET)
        return draw(self, logits)
    monkeypatch.setattr(SlotState, "draw", failing)


INJECTIONS: dict[str, tuple[Callable, bool, type, str]] = {
    # name: (inject, a structured bad request?, its error type, what its error names)
    "empty language": (_empty_language, True, InvalidRequest, FIELD),
    "structure's mask raises": (_mask_raises, True, InvalidRequest, FIELD),
    "structure's commit raises": (_commit_raises, True, RowFailed, "RuntimeError"),
    "NaN logits": (_poisoned_logits(float("nan")), False, RowFailed, "not finite"),
    "infinite logits": (_poisoned_logits(float("inf")), False, RowFailed, "not finite"),
    "advance raises": (_advance_raises, False, RowFailed, "KeyError"),
}


def _named(error: Exception, named: str) -> bool:
    return named in str(error) or named in [v.field for v in getattr(error, "violations", [])]


def _clean(error: Exception) -> bool:
    """Nothing of another request's input, nor the exception's own text."""
    text = str(error)
    return not any(p in text for p in PROMPTS + [MAIL_PROMPT, MAIL, SECRET])


@pytest.mark.parametrize("shape", list(INJECTIONS))
def test_one_rows_failure_ends_it_alone_and_the_batch_is_unchanged(llm, shape, monkeypatch):
    inject, structured, error_type, named = INJECTIONS[shape]
    alone = llm.run(_others(llm))
    bad = _bad(llm, structured)
    inject(llm, bad, monkeypatch)
    others = _others(llm)
    mixed = llm.run(others[:2] + [bad] + others[2:])
    failed = mixed.pop(2)
    assert [r.token_ids for r in mixed] == [r.token_ids for r in alone]  # token-identical without it
    assert all(r.error is None for r in mixed)
    assert isinstance(failed.error, error_type), repr(failed.error)
    assert _named(failed.error, named), str(failed.error)
    assert _clean(failed.error), str(failed.error)
    assert llm.runner.rows == {}  # every slot's model state dropped, the failed one's too
    assert llm.loop.idle and sorted(llm.loop.free_slots) == list(range(llm.runner.slots))


def test_a_stop_check_that_raises_ends_its_request_alone(llm):
    """A stop string is looked for when a canvas commits (RevisingSequence.apply_row_later)."""
    alone = llm.run(_others(llm))
    bad = _bad(llm, structured=False)
    bad.params = replace(bad.params, stop=("zz",))
    bad.find_stop_text = lambda ids: 1 // 0
    others = _others(llm)
    mixed = llm.run(others[:2] + [bad] + others[2:])
    failed = mixed.pop(2)
    assert [r.token_ids for r in mixed] == [r.token_ids for r in alone]
    assert isinstance(failed.error, RowFailed) and _named(failed.error, "ZeroDivisionError")
    assert llm.runner.rows == {}


def test_a_failed_row_streams_its_own_error_and_the_others_finish(llm, monkeypatch):
    """Through the asyncio scheduler: the failed request's stream raises its error; the rest end
    normally with the tokens of a run without it."""
    alone = [r.token_ids for r in llm.run(_others(llm))]
    bad = _bad(llm, structured=False)
    _poisoned_logits(float("nan"))(llm, bad, monkeypatch)
    others = _others(llm)
    out = stream_beside(llm, others[:2] + [bad] + others[2:])
    error = out.pop(2)
    assert isinstance(error, RowFailed) and "not finite" in str(error) and _clean(error)
    assert out == alone
