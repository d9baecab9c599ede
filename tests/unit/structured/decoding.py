"""Helpers the whole-document tests share: validation and a batch decoded beside a free request."""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema

from celeris.engine.llm import LLM
from celeris.engine.events import FinishReason
from celeris.engine.requests import Request
from celeris.engine.structured.constraint import Structured


def valid(schema: dict, text: str) -> None:
    """Raise unless text is JSON valid under the schema (its own draft, formats checked)."""
    cls = jsonschema.validators.validator_for(schema)
    cls(schema, format_checker=cls.FORMAT_CHECKER).validate(json.loads(text))


def decode_beside_free(llm: LLM, jobs: list[tuple[dict, int]]) -> None:
    """Each (schema, max_tokens) job decoded in one batch with a free request (one block, seed =
    its index, temperature 1): every document ends with its stop token and validates, and the
    free request reads as it does alone."""
    def params(n, seed):
        return replace(llm.defaults, gen_length=n, steps=n, block_length=n, temperature=1.0, seed=seed)

    seqs = [llm.build(Request(prompt="JSON:", params=params(n, s), structured=Structured("json_schema", schema, "s")))
            for s, (schema, n) in enumerate(jobs)]
    free = llm.build(Request(prompt="Once upon a time", params=params(32, 7)))
    outs = llm.run(seqs + [free])
    for (schema, _), out in zip(jobs, outs):
        assert out.error is None and out.finish_reason == FinishReason.STOP, out.text
        valid(schema, out.text)
    alone = llm.run([llm.build(Request(prompt="Once upon a time", params=params(32, 7)))])[0]
    assert outs[-1].error is None and outs[-1].text == alone.text
