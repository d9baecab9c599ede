"""The constraint budget (issue 60 item 5): one client's many structured rows keep to their share
of a step's mask work while another client runs (engine/loop/fair_share.within_constraint_budget),
counted, not timed: every `Constraint.window` call (one round of a row's token masks) of a step is
charged to its row's owner. The rows held back wait a step, and no row's tokens change: a
document beside the other client decodes the very tokens it does alone, and so does the plain
request."""

from __future__ import annotations

import collections
from dataclasses import replace

import pytest
import torch

from celeris.engine.config import EngineConfig
from celeris.engine.llm import LLM
from celeris.engine.loop import fair_share
from celeris.engine.events import FinishReason
from celeris.engine.requests import Request
from celeris.engine.structured import constraint as constraint_module
from celeris.engine.structured.constraint import Structured
from tests.unit.structured.decoding import valid

SCHEMA = {"type": "object", "required": ["city", "days"],
          "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer"}}}
BUDGET = 16
SAMPLES = 16


@pytest.fixture(scope="module")
def budget_llm() -> LLM:
    return LLM.load(None, EngineConfig(max_batch=SAMPLES + 1, constraint_budget=BUDGET))


def _params(llm: LLM, n: int, seed: int):
    # n positions in n / 2 steps: each row chains one position past its front (two rounds of masks a step)
    return replace(llm.defaults, gen_length=n, steps=n // 2, block_length=n, temperature=1.0, seed=seed)


def _documents(llm: LLM, owner: str) -> list:
    seqs = [llm.build(Request(prompt="JSON:", params=_params(llm, 48, k + 1),
                              structured=Structured("json_schema", SCHEMA, "s"))) for k in range(SAMPLES)]
    for s in seqs:
        s.owner = owner
    return seqs


def _plain(llm: LLM, owner: str):
    seq = llm.build(Request(prompt="Once upon a time", params=_params(llm, 16, 7)))
    seq.owner = owner
    return seq


def _run_counting(llm: LLM, seqs: list, monkeypatch) -> list[collections.Counter]:
    """Run `seqs` to the end on `llm`'s loop: per step, the `Constraint.window` calls by owner."""
    owner_of = {id(s.constraint): s.owner for s in seqs if s.constraint is not None}
    steps: list[collections.Counter] = []
    real = constraint_module.Constraint.window

    def window(self, cols):
        steps[-1][owner_of[id(self)]] += 1
        return real(self, cols)
    monkeypatch.setattr(constraint_module.Constraint, "window", window)
    for s in seqs:
        llm.loop.add(s, bounded=False)
    with torch.inference_mode():
        while not llm.loop.idle:
            steps.append(collections.Counter())
            llm.loop.step()
    monkeypatch.undo()
    return steps


def test_many_documents_keep_to_their_share_of_mask_work_beside_another_client(budget_llm, monkeypatch):
    llm = budget_llm
    docs, plain = _documents(llm, "client-a"), _plain(llm, "client-b")
    steps = _run_counting(llm, docs + [plain], monkeypatch)
    share = fair_share.share(BUDGET, 2)
    busy = [c["client-a"] for c, done in zip(steps, _plain_running(steps, plain)) if done]
    assert busy and max(busy) <= share, busy  # today's code: 16 rows x 2 rounds = 32 in its first steps
    for s in docs:  # every document still ends whole and valid
        out = llm.result(s)
        assert out.error is None and out.finish_reason == FinishReason.STOP, out.text
        valid(SCHEMA, out.text)
    alone_docs = llm.run(_documents(llm, "client-a"))
    alone_plain = llm.run([_plain(llm, "client-b")])[0]
    assert [llm.result(s).text for s in docs] == [o.text for o in alone_docs]  # waiting changed no token
    assert llm.result(plain).text == alone_plain.text


def _plain_running(steps: list, plain) -> list[bool]:
    """Whether the plain request was still running at each step: it ran for its first `nfe` steps
    (admitted at once, and a plain row is never held back by the constraint budget)."""
    return [k < plain.nfe for k in range(len(steps))]


def test_one_client_alone_is_not_limited(budget_llm, monkeypatch):
    llm = budget_llm
    steps = _run_counting(llm, _documents(llm, "client-a"), monkeypatch)
    assert max(c["client-a"] for c in steps) > fair_share.share(BUDGET, 2)  # nobody waits on its masks
