"""Reasoning parsers (vLLM's `--reasoning-parser`): a finished generation's thinking-channel text
split from its content, so a door can return it as `reasoning_content`.

- "gemma": DiffusionGemma / Gemma 4's channel, `<|channel>thought\\n ... <channel|>`. The model
  writes the channel even with thinking off (then usually empty): the markers never reach the
  content either way, and an empty channel is no reasoning (None).
- "qwen3": `<think> ... </think>` (Qwen3, SDAR, LLaDA2.x / Ling templates). A template whose
  generation prompt already opened `<think>` leaves only the closing tag in the output: text
  before a lone `</think>` is reasoning.

An unclosed channel (the canvas ran out while thinking) is all reasoning and no content. The
markers are read as text: decode with `Tokenizer.decode_markup` where they are special tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str  # the channel's opening marker (its header included, e.g. Gemma's "thought")
    end: str

    def split(self, text: str) -> tuple[Optional[str], str]:
        """(reasoning or None, content)."""
        i = text.find(self.start)
        j = text.find(self.end, i + len(self.start) if i >= 0 else 0)
        if i < 0 and j < 0:
            return None, text
        if i < 0:  # opened by the prompt: everything before the close is reasoning
            before, inner, after = "", text[:j], text[j + len(self.end):]
        elif j < 0:  # never closed
            before, inner, after = text[:i], text[i + len(self.start):], ""
        else:
            before, inner, after = text[:i], text[i + len(self.start):j], text[j + len(self.end):]
        inner = inner.strip("\n")
        content = (before.rstrip() + ("\n" if before.strip() and after.strip() else "") + after.lstrip())
        return (inner if inner.strip() else None), content


REASONING_PARSERS: dict[str, ReasoningParser] = {p.name: p for p in (
    ReasoningParser("gemma", "<|channel>thought", "<channel|>"),
    ReasoningParser("qwen3", "<think>", "</think>"),
)}


def detect_reasoning_parser(chat_template: str) -> Optional[str]:
    """The reasoning parser a chat template's markup implies, or None."""
    if not isinstance(chat_template, str):
        return None
    if "<|channel>" in chat_template:
        return "gemma"
    if "<think>" in chat_template or "</think>" in chat_template:
        return "qwen3"
    return None


__all__ = ["ReasoningParser", "REASONING_PARSERS", "detect_reasoning_parser"]
