"""Shared fixtures: tiny random models written as real checkpoint folders."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import make_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random LLaDA-format checkpoint (peaked logits, so confidences rarely tie) + tokenizer."""
    return make_model_dir(tmp_path_factory.mktemp("tiny-llada"), seed=0)


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir):
    from celeris.engine.config import EngineConfig
    from celeris.engine.llm import LLM

    return LLM.load(tiny_model_dir, EngineConfig(max_batch=16, max_queue=32, max_prompt_tokens=64, max_gen_length=64))
