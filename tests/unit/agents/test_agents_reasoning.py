"""Reasoning parsers (engine/agents/reasoning.py, issue 43): the thinking channel split from the
content, DiffusionGemma's channel (present even with thinking off) and Qwen3's think tags."""

from __future__ import annotations

import pytest

from celeris.engine.agents.reasoning import REASONING_PARSERS, detect_reasoning_parser
from celeris.engine.tokenizer import DEFAULT_CHAT_TEMPLATE
from tests.unit.agent_templates import GEMMA_STYLE, QWEN_STYLE

GEMMA = REASONING_PARSERS["gemma"]
QWEN3 = REASONING_PARSERS["qwen3"]


@pytest.mark.parametrize("text,expected", [
    ("<|channel>thought\nFirst, 2+2.\nSo 4.<channel|>It is 4.", ("First, 2+2.\nSo 4.", "It is 4.")),
    ("<|channel>thought\n<channel|>Hello.", (None, "Hello.")),  # thinking off: an empty channel
    ("<|channel>thought\nstill thinking when the canvas ended", ("still thinking when the canvas ended", "")),
    ("Plain answer.", (None, "Plain answer.")),
    ("<|channel>thought\nx<channel|><|tool_call>call:f{}<tool_call|>", ("x", "<|tool_call>call:f{}<tool_call|>")),
])
def test_gemma_channel(text, expected):
    assert GEMMA.split(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("<think>\nhmm\n</think>\n\nAnswer", ("hmm", "Answer")),
    ("hmm, the prompt opened it</think>\n\nAnswer", ("hmm, the prompt opened it", "Answer")),
    ("<think>\n\n</think>\n\nAnswer", (None, "Answer")),
    ("<think>cut off", ("cut off", "")),
    ("No tags.", (None, "No tags.")),
])
def test_qwen3_think_tags(text, expected):
    assert QWEN3.split(text) == expected


def test_detection():
    assert detect_reasoning_parser(GEMMA_STYLE) == "gemma"
    assert detect_reasoning_parser(QWEN_STYLE) == "qwen3"
    assert detect_reasoning_parser(DEFAULT_CHAT_TEMPLATE) is None and detect_reasoning_parser(None) is None
