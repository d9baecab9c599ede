"""Fixtures the structured-output tests share: celeris-tiny and a compiler on its tokenizer.

Module-scoped, as each module had them: verdicts are remembered per compiler and some modules
change the constraint's limits, so no state crosses modules. test_structured.py keeps its own
(both embedded models)."""

from __future__ import annotations

import pytest

from celeris.engine.llm import EMBEDDED_MODELS, LLM
from celeris.engine.structured.constraint import Compiler


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM.load(EMBEDDED_MODELS["celeris-tiny"])


@pytest.fixture(scope="module")
def compiler(llm) -> Compiler:
    return Compiler(llm.tokenizer, llm.requests.family_vocab)
