"""LLaDA2.2 as the tests' reference: its config keys, its gate, and a tiny folder of its format.

LLaDA2.2 (inclusionAI LLaDA2.2-flash) keeps LLaDA2.1's architecture name, tensor names and
layout; its config.json adds `block_size` 32 and `expert_capacity` 48 (the block-routed gate) and
`delete_token_id` / `split_token_id` (156930 / 156931 on flash: ordinary vocabulary ids its loop
may write), and its generation_config.json lists two stop ids. The released gate, as its model
card's modeling file describes it: scores = sigmoid(h W^T) in float32 plus expert_bias; over each
`block_size` tokens (the flattened batch-1 window, whose length the reference asserts is a
multiple of it) every expert scores its best token score; the block keeps its top
`expert_capacity` experts, each token its top-k among them; weights are the unbiased scores,
normalised and scaled as in LLaDA2.0. Transcribed here in plain torch, independently of
engine/models/moe.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from tests.unit.block_references.checkpoints import EOS_ID, write_llada2_checkpoint
from tests.unit.block_references.modeling import LLaDA2Model

# The tiny checkpoints' edit ids: ordinary ids of the vocabulary (as 156930/156931 are on flash),
# and a second stop id (flash lists <|endoftext|> and <|role_end|>).
DELETE_ID, SPLIT_ID, ROLE_END_ID = 1000, 1001, 1002
LLADA22_KEYS = dict(block_size=32, expert_capacity=4, delete_token_id=DELETE_ID, split_token_id=SPLIT_ID,
                    num_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, use_qk_norm=True)


def block_routed_gate(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, block: int, capacity: int,
                      top_k: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h (N, D) -> expert ids (N, k), float32 weights (N, k), as the released gate."""
    scores = torch.sigmoid(F.linear(h.float(), weight.float()))
    choice = scores + bias.float()
    N, E = choice.shape
    assert N % block == 0, "the released gate asserts a block-aligned window"
    per_block = choice.view(N // block, block, E).max(dim=1).values
    allowed = torch.zeros(N // block, E, dtype=torch.bool)
    allowed[torch.arange(N // block)[:, None], per_block.topk(capacity, dim=-1).indices] = True
    allowed = allowed.repeat_interleave(block, dim=0)
    idx = choice.masked_fill(~allowed, float("-inf")).topk(top_k, dim=-1).indices
    w = scores.gather(1, idx)
    if top_k > 1:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return idx, w * scaling


class LLaDA22Model(LLaDA2Model):
    """The reference LLaDA2 model with the released block-routed gate."""

    def route(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = f"model.layers.{i}.mlp.gate"
        c = self.cfg
        return block_routed_gate(h, self.w[f"{p}.weight"], self.w[f"{p}.expert_bias"], c["block_size"],
                                 c["expert_capacity"], self.top_k, self.scaling)


def write_llada22_checkpoint(folder: Path, seed: int = 0, **overrides) -> Path:
    """A random LLaDA2.2-format folder: LLaDA2's tensors, LLaDA2.2's config keys, two stop ids."""
    folder = write_llada2_checkpoint(folder, seed, torch.float32, **(LLADA22_KEYS | overrides))
    gen = json.loads((folder / "generation_config.json").read_text())
    gen["eos_token_id"] = [EOS_ID, ROLE_END_ID]
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return folder
