"""LLaDA2's router bias in bfloat16, as the published model holds it.

The published LLaDA2 model registers `expert_bias` as a buffer, so `model.to(torch.bfloat16)`
rounds it to bf16; its router adds it to float32 sigmoid scores. Celeris used to keep the bias in
full float32, which picks other experts for some tokens (bf16 decodes differed from the published
model). Now the loaded bias holds the model dtype's values.
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from celeris.engine.families.checkpoint import load_model
from tests.unit.block_references.checkpoints import write_llada2_checkpoint


def _route(gate, h: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    saved = gate.expert_bias.clone()
    gate.expert_bias.copy_(bias)
    try:
        return gate(h)[0].sort(-1).values
    finally:
        gate.expert_bias.copy_(saved)


def test_the_router_bias_is_rounded_to_the_model_dtype(tmp_path):
    folder = write_llada2_checkpoint(tmp_path / "m", seed=4)
    stored = load_file(str(folder / "model.safetensors"))["model.layers.1.mlp.gate.expert_bias"]
    bf16 = load_model(folder, dtype="bfloat16")
    gate = bf16.transformer.blocks[1].mlp.gate
    assert gate.expert_bias.dtype == torch.float32  # added to float32 scores, as published
    assert torch.equal(gate.expert_bias, stored.to(torch.bfloat16).float())
    assert not torch.equal(stored.to(torch.bfloat16).float(), stored)  # the rounding is not a no-op here
    fp32 = load_model(folder, dtype="float32").transformer.blocks[1].mlp.gate
    assert torch.equal(fp32.expert_bias, stored)  # float32 models keep it whole


def test_the_rounding_changes_which_experts_some_tokens_use(tmp_path):
    """Why it matters: routing with the published (rounded) bias and with the full one differ."""
    folder = write_llada2_checkpoint(tmp_path / "m", seed=4)
    stored = load_file(str(folder / "model.safetensors"))["model.layers.1.mlp.gate.expert_bias"]
    gate = load_model(folder, dtype="float32").transformer.blocks[1].mlp.gate
    h = torch.randn(4000, gate.weight.shape[1], generator=torch.Generator().manual_seed(0))
    published, full = _route(gate, h, stored.to(torch.bfloat16).float()), _route(gate, h, stored)
    assert (published != full).any(-1).sum() > 0
