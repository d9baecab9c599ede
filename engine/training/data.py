"""Tokenizer training and batches for celeris-tiny.

Text: Jane Austen's paragraphs, each as `<|bos|> paragraph <|eos|>`, packed into one stream and
cut into random fixed-length windows (pretraining). Skill: `<|bos|>37+45=` followed by the
answer and EOS padding to SKILL_GEN_LENGTH (supervised: only the answer region is ever masked,
as in LLaDA's SFT, so the model learns to fill a masked answer and pad it with EOS).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

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


def save_tokenizer(tok: Tokenizer, folder: Path) -> None:
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>", "mask_token": "<|mask|>",
        "add_bos_token": True,
    }, indent=2) + "\n")


@dataclass
class Batches:
    """Random training batches from a packed text stream and a list of skill examples."""

    stream: torch.Tensor  # (N,) token ids of all training paragraphs
    skill: torch.Tensor  # (M, Ls) skill examples, equal length
    skill_prompt_len: torch.Tensor  # (M,) tokens before the answer region
    rng: torch.Generator

    def text(self, batch: int, seq_len: int) -> torch.Tensor:
        starts = torch.randint(0, len(self.stream) - seq_len, (batch,), generator=self.rng)
        return torch.stack([self.stream[s:s + seq_len] for s in starts.tolist()])  # (B, L)

    def skills(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, len(self.skill), (batch,), generator=self.rng)
        return self.skill[idx], self.skill_prompt_len[idx]


def encode_paragraphs(tok: Tokenizer, paragraphs: list[str]) -> torch.Tensor:
    out: list[int] = []
    for enc in tok.encode_batch(paragraphs, add_special_tokens=False):
        out += [BOS_ID, *enc.ids, EOS_ID]
    return torch.tensor(out, dtype=torch.long)


def encode_skill(tok: Tokenizer, pairs: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad every example's answer with EOS to SKILL_GEN_LENGTH and left-pad prompts to one length."""
    rows, plens = [], []
    prompt_ids = [[BOS_ID, *tok.encode(p, add_special_tokens=False).ids] for p, _ in pairs]
    width = max(len(p) for p in prompt_ids)
    for (prompt, answer), p in zip(pairs, prompt_ids):
        a = tok.encode(answer, add_special_tokens=False).ids
        a = a + [EOS_ID] * (SKILL_GEN_LENGTH - len(a))
        # Left padding keeps the answer at a fixed offset; pad tokens are just more context.
        rows.append([PAD_ID] * (width - len(p)) + p + a[:SKILL_GEN_LENGTH])
        plens.append(width)
    return torch.tensor(rows), torch.tensor(plens)


def split_paragraphs(novels: dict[str, list[str]], every: int = 50) -> tuple[list[str], list[str]]:
    """Every `every`-th paragraph of each novel is held out for the masked-token loss."""
    train, held = [], []
    for paragraphs in novels.values():
        for i, p in enumerate(paragraphs):
            (held if i % every == every - 1 else train).append(p)
    return train, held


def make_batches(tok: Tokenizer, paragraphs: list[str], pairs: list[tuple[str, str]], seed: int) -> Batches:
    paragraphs = list(paragraphs)
    random.Random(seed).shuffle(paragraphs)
    skill, plen = encode_skill(tok, pairs)
    return Batches(encode_paragraphs(tok, paragraphs), skill, plen, torch.Generator().manual_seed(seed))
