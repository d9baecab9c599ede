"""A constrained request keeps the pace it asked for (families.selection.chained): with fewer steps than
tokens each slot commits several positions a step, left to right, each under its own mask; a
threshold row chains only the picks at or above its threshold. Beside free requests, which decode
as they do alone; a structure that breaks mid-chain ends its own request only."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import jsonschema
import llguidance
import pytest

from celeris.engine.llm import EMBEDDED_MODELS, LLM
from celeris.engine.events import FinishReason
from celeris.engine.requests import Request
from celeris.engine.structured.constraint import Structured

from .test_structured_document import NODE, ROWS, SKELETON


@pytest.fixture(scope="module", params=["celeris-tiny", "celeris-tiny-block"])
def model(request) -> LLM:
    return LLM.load(EMBEDDED_MODELS[request.param])


def _params(llm: LLM, seed: int, steps: int, n: int = 64, **kw):
    return replace(llm.defaults, gen_length=n, steps=steps, block_length=32, temperature=1.0, seed=seed, **kw)


def _schema(llm: LLM, schema: dict, seed: int, steps: int, **kw):
    return llm.build(Request(prompt="JSON:", params=_params(llm, seed, steps, **kw),
                             structured=Structured("json_schema", schema, "s")))


def _free(llm: LLM, steps: int):
    return llm.build(Request(prompt="It was", params=_params(llm, 9, steps)))


def test_a_document_keeps_the_pace_asked_for_beside_free_requests(model):
    """Steps = gen_length / 4: four positions a slot a step. Without the chain a document took a
    step a token (the steps = gen_length runs below), several times the steps asked for."""
    jobs = [(NODE, 1), (ROWS, 2), (SKELETON, 3)]
    slow = [_schema(model, s, seed, 64) for s, seed in jobs]
    model.run(slow)
    fast = [_schema(model, s, seed, 16) for s, seed in jobs]
    outs = model.run(fast + [_free(model, 16)])
    for (schema, _), seq, out in zip(jobs, fast, outs):
        assert out.error is None and out.finish_reason == FinishReason.STOP, out.text
        jsonschema.validate(json.loads(out.text), schema)
        assert seq.nfe <= 16, (seq.nfe, out.text)
    assert max(s.nfe for s in slow[:2]) > 16  # one token a step: the documents need more
    alone = model.run([_free(model, 16)])[0]
    assert outs[-1].token_ids == alone.token_ids
    for (schema, seed), out in zip(jobs, outs):  # a constrained row decodes the same alone
        assert model.run([_schema(model, schema, seed, 16)])[0].token_ids == out.token_ids


def test_a_threshold_row_chains_only_confident_picks():
    """A random model is unsure between the regex's letters: at threshold 0.99 a step keeps only
    its front (and what the grammar forces), at 0.01 nearly the whole slot in one step."""
    llm = LLM.load(EMBEDDED_MODELS["celeris-tiny"])
    regex = "(ab|ba){12}"

    def run(threshold: float):
        seq = llm.build(Request(prompt="Letters:", params=_params(llm, 4, 32, n=32, threshold=threshold),
                                structured=Structured("regex", regex, "r")))
        out = llm.run([seq, _free(llm, 64)])[0]
        assert out.error is None and re.fullmatch(regex, out.text), out.text
        return seq.nfe

    sure, unsure = run(0.01), run(0.99)
    assert sure <= 3 and unsure >= 8, (sure, unsure)


class _Refusing:
    """An llguidance matcher that refuses every token after its first `n`."""

    def __init__(self, m: llguidance.LLMatcher, n: int):
        self._m, self._n = m, n

    def consume_token(self, t: int) -> bool:
        self._n -= 1
        return self._n >= 0 and self._m.consume_token(t)

    def __getattr__(self, name):
        return getattr(self._m, name)


def test_a_structure_breaking_mid_chain_ends_its_own_request_only(model):
    long_name = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string", "minLength": 12}}}
    broken = _schema(model, long_name, 5, 8)  # 8 positions a step: the name's letters are chained
    broken.constraint._matchers[0] = _Refusing(broken.constraint._matchers[0], 3)
    other = _schema(model, NODE, 6, 16)
    outs = model.run([broken, other, _free(model, 16)])
    assert outs[0].error is not None and "refused" in str(outs[0].error), outs[0]
    assert outs[1].error is None and outs[1].token_ids == model.run([_schema(model, NODE, 6, 16)])[0].token_ids
    assert outs[2].token_ids == model.run([_free(model, 16)])[0].token_ids
