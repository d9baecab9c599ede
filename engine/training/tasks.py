"""celeris-tiny v2's supervised examples: (prompt ids, response ids), the response padded with EOS.

Instruction-tuned masked-diffusion models (LLaDA-Instruct) are fine-tuned on responses padded
with EOS to the canvas length, so a long canvas ends early with the answer: the model learns
that everything after an answer is EOS. Each example here is drawn with a canvas length from
`CANVASES`; its response is cut to that length (a continuation longer than the canvas simply
fills it) or padded with EOS to it. Four formats, all from the training split only:

- continuation: `<bos>` + the first words of an Austen paragraph -> the rest of the paragraph;
- addition: `<bos>37+45=` -> `82`;
- chat addition: the chat template around "What is 37+45?" -> `82`;
- chat continuation: "Continue: <first words>" -> the rest of the paragraph;
- chat question: "Which novel is this from? <a sentence>" -> the novel's title.

Chat turns are rendered with the template the tokenizer ships (`Tokenizer.encode_chat`), so
training sees exactly the ids a chat request is served with.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Optional

from celeris.engine.training import skill

CANVASES = (4, 8, 16, 32, 64, 128, 256)  # canvas lengths responses are padded to
# Relative frequency of each canvas length: long canvases cost more per example, short ones
# carry most of the answers, and every length a user may pick must be seen.
CANVAS_WEIGHTS = (3, 2, 2, 2, 3, 1, 1)
# The long-canvas phase's addition batches (engine/training/train.py): mostly 128 and 256, where
# a full-canvas model must keep a two-digit answer beside ~250 still-masked positions.
LONG_CANVAS_WEIGHTS = (1, 1, 1, 1, 2, 3, 9)
MAX_PROMPT_WORDS = 24


@dataclass(frozen=True)
class Example:
    prompt: list[int]
    response: list[int]  # exactly the canvas length: the answer, then EOS padding


class TaskMaker:
    """Draws examples of every format. `encode(text) -> ids` (no BOS), `chat(question) -> ids`."""

    def __init__(self, encode, chat, bos_id: int, eos_id: int, paragraphs: dict[str, list[str]], seed: int):
        self.encode, self.chat, self.bos, self.eos = encode, chat, bos_id, eos_id
        self.rng = random.Random(seed)
        self.paragraphs = [(title, p) for title, ps in paragraphs.items() for p in ps if len(p.split()) >= 6]
        self.pairs = skill.train_pairs(40_000, seed=skill.SEED + seed)

    def canvas(self, weights: Optional[tuple[int, ...]] = None) -> int:
        return self.rng.choices(CANVASES, weights or CANVAS_WEIGHTS)[0]

    def pad(self, ids: list[int], canvas: int) -> list[int]:
        return ids[:canvas] + [self.eos] * (canvas - len(ids))

    def example(self, canvas: int) -> Example:
        kind = self.rng.random()
        if kind < 0.35:
            return self.continuation(canvas, chat=False)
        if kind < 0.60:
            return self.addition(canvas, chat=False)
        if kind < 0.72:
            return self.addition(canvas, chat=True)
        if kind < 0.87:
            return self.continuation(canvas, chat=True)
        return self.novel_question(canvas)

    def addition(self, canvas: int, chat: bool) -> Example:
        prompt, answer = self.rng.choice(self.pairs)
        ids = self.chat(f"What is {prompt[:-1]}?") if chat else [self.bos, *self.encode(prompt)]
        return Example(ids, self.pad(self.encode(answer), canvas))

    def continuation(self, canvas: int, chat: bool) -> Example:
        _, text = self.rng.choice(self.paragraphs)
        words = text.split(" ")
        k = self.rng.randint(1, min(MAX_PROMPT_WORDS, len(words) - 1))
        head, tail = " ".join(words[:k]), " " + " ".join(words[k:])
        ids = self.chat(f"Continue: {head}") if chat else [self.bos, *self.encode(head)]
        return Example(ids, self.pad(self.encode(tail if not chat else tail.lstrip()), canvas))

    def novel_question(self, canvas: int) -> Example:
        title, text = self.rng.choice(self.paragraphs)
        sentences = [s for s in re.split(r"(?<=[.!?])\s+", text) if 4 <= len(s.split()) <= 30]
        sentence = self.rng.choice(sentences) if sentences else " ".join(text.split()[:20])
        return Example(self.chat(f"Which novel is this from? {sentence}"), self.pad(self.encode(title), canvas))
