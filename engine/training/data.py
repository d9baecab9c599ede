"""Tokenizer training and batches for celeris-tiny.

Text: Jane Austen's paragraphs, each as `<|bos|> paragraph <|eos|>`, packed into one stream and
cut into random fixed-length windows (pretraining). Supervised: `tasks.TaskMaker`'s examples
(continuations, additions, chat turns), responses EOS-padded to a drawn canvas length; only the
response is ever masked, as in LLaDA's SFT, so the model learns to answer and then pad with EOS.
Additions also get batches of their own (many problems per step).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from celeris.engine.config import ModelConfig
from celeris.engine.tokenizer import DEFAULT_CHAT_TEMPLATE
from celeris.engine.tokenizer import Tokenizer as ServedTokenizer
from celeris.engine.training.tasks import Example, TaskMaker
from celeris.engine.training.tool_tasks import ToolTaskMaker

SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|mask|>", "<|system|>", "<|user|>", "<|assistant|>"]
PAD_ID, BOS_ID, EOS_ID, MASK_ID = 0, 1, 2, 3
SKILL_GEN_LENGTH = 4  # answers are 2-3 digits, then EOS


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE; digits are split one per token so arithmetic stays learnable."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    assert [tok.token_to_id(s) for s in SPECIALS[:4]] == [PAD_ID, BOS_ID, EOS_ID, MASK_ID]
    return tok


TOKENIZER_CONFIG = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>", "mask_token": "<|mask|>",
                    "add_bos_token": True, "chat_template": DEFAULT_CHAT_TEMPLATE}


def save_tokenizer(tok: Tokenizer, folder: Path) -> None:
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")


@dataclass
class Batches:
    """Training batches: random windows of a packed text stream (pretraining), and supervised
    examples with EOS-padded responses (`tasks.TaskMaker`). Each is (ids, real, maskable), all
    (B, L): real is False at left padding, maskable marks what the loss may mask."""

    stream: torch.Tensor  # (N,) token ids of all training paragraphs
    tasks: TaskMaker
    rng: torch.Generator
    tools: Optional[ToolTaskMaker] = None  # the tools phase's conversations (`make_batches(tools=True)`)

    def text(self, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.stream) - seq_len, (batch,), generator=self.rng)
        x = torch.stack([self.stream[s:s + seq_len] for s in starts.tolist()])  # (B, L)
        real = torch.ones_like(x, dtype=torch.bool)
        return x, real, real

    def supervised(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """About `tokens` tokens of examples, all of one canvas length (drawn per batch)."""
        canvas = self.tasks.canvas()
        return self._fill(lambda: self.tasks.example(canvas), canvas, tokens)

    def additions(self, tokens: int, most: int = 256, canvas_weights: Optional[tuple[int, ...]] = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Up to `most` addition problems (a third in the chat format), all of one canvas length
        (drawn by `canvas_weights`, default the supervised mix's), in about `tokens` tokens: the
        skill's own batches, as a tiny model learns carrying only from many problems per step
        (celeris-tiny v1's finding)."""
        canvas = self.tasks.canvas(canvas_weights)
        return self._fill(lambda: self.tasks.addition(canvas, chat=self.tasks.rng.random() < 1 / 3), canvas, tokens,
                          most)

    def tool_calls(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """About `tokens` tokens of tool-use conversations (`tool_tasks`), one drawn canvas (a
        row's canvas grows to hold its calls; the batch's responses are EOS-padded to the longest)."""
        canvas = self.tasks.rng.choices(TOOL_CANVASES, TOOL_CANVAS_WEIGHTS)[0]
        examples = [self.tools.example(canvas)]
        while True:
            e = self.tools.example(canvas)
            rows = examples + [e]
            if len(rows) * (max(len(r.prompt) for r in rows) + max(len(r.response) for r in rows)) > tokens:
                break
            examples = rows
        width = max(len(e.response) for e in examples)
        return pack([Example(e.prompt, e.response + [EOS_ID] * (width - len(e.response))) for e in examples], PAD_ID)

    def long_tool_call(self, max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One tool-use conversation of up to `max_len` tokens, mostly prose before the request."""
        canvas = self.tasks.rng.choices(TOOL_CANVASES, TOOL_CANVAS_WEIGHTS)[0]
        return pack([self.tools.long_example(max_len, canvas)], PAD_ID)

    @staticmethod
    def _fill(draw, canvas: int, tokens: int, most: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Examples from `draw()` while the padded batch (rows x widest prompt + canvas) stays
        within `tokens` (and `most` rows); always at least one."""
        examples = [draw()]
        while (most is None or len(examples) < most) and \
                (len(examples) + 1) * (max(len(e.prompt) for e in examples) + canvas) <= tokens:
            examples.append(draw())
        return pack(examples, PAD_ID)


def pack(examples: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad [prompt | response] rows to one width; only responses are maskable."""
    width = max(len(e.prompt) for e in examples) + len(examples[0].response)
    rows, real, maskable = [], [], []
    for e in examples:
        n_pad = width - len(e.prompt) - len(e.response)
        rows.append([pad_id] * n_pad + e.prompt + e.response)
        real.append([False] * n_pad + [True] * (len(e.prompt) + len(e.response)))
        maskable.append([False] * (n_pad + len(e.prompt)) + [True] * len(e.response))
    return torch.tensor(rows), torch.tensor(real), torch.tensor(maskable)


def encode_paragraphs(tok: Tokenizer, paragraphs: list[str]) -> torch.Tensor:
    out: list[int] = []
    for enc in tok.encode_batch(paragraphs, add_special_tokens=False):
        out += [BOS_ID, *enc.ids, EOS_ID]
    return torch.tensor(out, dtype=torch.long)


def split_paragraphs(novels: dict[str, list[str]], every: int = 50) -> tuple[list[str], list[str]]:
    """Every `every`-th paragraph of each novel is held out for the masked-token loss."""
    train, held = [], []
    for paragraphs in novels.values():
        for i, p in enumerate(paragraphs):
            (held if i % every == every - 1 else train).append(p)
    return train, held


def split_by_novel(novels: dict[str, list[str]], every: int = 50) -> dict[str, list[str]]:
    """The training paragraphs of each novel (the same split as `split_paragraphs`)."""
    return {title: [p for i, p in enumerate(ps) if i % every != every - 1] for title, ps in novels.items()}


# The tools phase's canvases: a call is ~50 tokens, two ~100 (a row's canvas grows to hold its
# answer); 64 is the served default max_tokens.
TOOL_CANVASES = (32, 64, 128, 256)
TOOL_CANVAS_WEIGHTS = (1, 3, 3, 2)
CONTINUE_WORDS = 40  # a "Continue:" answer under tools is cut here (the canvas would cut it anyway)


def plain_turn(maker: TaskMaker, rng: random.Random) -> tuple[str, str]:
    """(question, answer text) of a chat turn no tool answers: a one-digit or two-digit addition
    (training pairs only), a "Continue:" turn or a "Which novel is this from?" turn."""
    kind = rng.random()
    if kind < 0.3:
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        return rng.choice((f"What is {a}+{b}?", f"what is {a}+{b}", f"What is {a} + {b}?")), str(a + b)
    if kind < 0.6:
        prompt, answer = rng.choice(maker.pairs)
        return f"What is {prompt[:-1]}?", answer
    title, text = rng.choice(maker.paragraphs)
    words = text.split(" ")
    if kind < 0.8:
        k = rng.randint(1, min(24, len(words) - 1))
        return f"Continue: {' '.join(words[:k])}", " ".join(words[k:k + CONTINUE_WORDS])
    return f"Which novel is this from? {' '.join(words[:rng.randint(6, 20)])}", title


def make_batches(tok: Tokenizer, novels: dict[str, list[str]], seed: int, tools: bool = False) -> Batches:
    train = split_by_novel(novels)
    paragraphs = [p for ps in train.values() for p in ps]
    random.Random(seed).shuffle(paragraphs)
    served = ServedTokenizer(tok, ModelConfig(vocab_size=tok.get_vocab_size(), embedding_size=tok.get_vocab_size(),
                                              mask_token_id=MASK_ID, eos_token_id=EOS_ID), TOKENIZER_CONFIG)
    encode = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    chat = lambda q: served.encode_chat([{"role": "user", "content": q}])  # noqa: E731
    maker = TaskMaker(encode, chat, BOS_ID, EOS_ID, train, seed)
    tool_maker = None
    if tools:
        def filler(rng: random.Random, n_tokens: int) -> str:
            start = rng.randrange(len(paragraphs))
            ids: list[int] = []
            for p in paragraphs[start:] + paragraphs[:start]:
                ids += encode(p + "\n\n")
                if len(ids) >= n_tokens:
                    break
            return tok.decode(ids[:n_tokens]).strip()

        tool_maker = ToolTaskMaker(lambda m, t: served.encode_chat(m, tools=t), encode,
                                   lambda rng: plain_turn(maker, rng), filler, EOS_ID, seed)
    return Batches(encode_paragraphs(tok, paragraphs), maker, torch.Generator().manual_seed(seed), tool_maker)
