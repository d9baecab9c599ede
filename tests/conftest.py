"""Shared fixtures: tiny random models written as real checkpoint folders."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The generated stubs live in protos/celeris/ and import each other as celeris.v1...; the
# installed package maps "celeris" there. Without an install, put protos/ on the path.
try:
    import celeris.v1  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "protos"))

from tests.helpers import make_model_dir  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random LLaDA-format checkpoint (peaked logits, so confidences rarely tie) + tokenizer."""
    return make_model_dir(tmp_path_factory.mktemp("tiny-llada"), seed=0)


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir):
    from celeris.engine.config import EngineConfig
    from celeris.engine.llm import LLM

    return LLM.load(tiny_model_dir, EngineConfig(max_batch=16, max_queue=32, max_prompt_tokens=64, max_gen_length=64))
