"""LLaDA2.2's block-routed MoE gate (engine/models/moe.py) against a plain-torch transcription of
the released gate (tests/unit/block_references/llada22.py), on random weights and on a tiny
checkpoint's layers."""

from __future__ import annotations

import pytest
import torch

from celeris.engine.config import ModelConfig
from celeris.engine.families.checkpoint import load_model
from celeris.engine.models.moe import MoE, Router
from tests.unit.block_references.llada22 import LLADA22_KEYS, block_routed_gate, write_llada22_checkpoint


def _router(capacity: int, block: int = 8, E: int = 16, k: int = 4, seed: int = 0) -> Router:
    cfg = ModelConfig(d_model=24, n_heads=4, n_kv_heads=4, num_experts=E, experts_per_token=k, n_group=4,
                      topk_group=2, routed_scaling_factor=2.5, expert_capacity=capacity, routing_block=block,
                      moe_hidden_size=8)
    r = Router(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        r.weight.copy_(torch.randn(r.weight.shape, generator=g))
        r.expert_bias.copy_(torch.randn(E, generator=g) * 0.05)
    return r


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_gate_is_the_released_one(seed):
    r = _router(capacity=6, seed=seed)
    h = torch.randn(3 * 8, 24, generator=torch.Generator().manual_seed(10 + seed))
    idx, w = r(h)
    ref_idx, ref_w = block_routed_gate(h, r.weight, r.expert_bias, 8, 6, 4, 2.5)
    assert torch.equal(idx, ref_idx)
    assert torch.equal(w, ref_w)
    per_block = idx.view(3, 8 * 4)
    assert all(len(set(b.tolist())) <= 6 for b in per_block)  # a block uses at most its capacity


def test_block_routing_is_not_the_grouped_gate():
    """The test can fail: the grouped gate picks other experts for some tokens of the same input."""
    h = torch.randn(64, 24, generator=torch.Generator().manual_seed(3))
    blocked, grouped = _router(capacity=6)(h)[0], _router(capacity=0)(h)[0]
    assert (blocked.sort(-1).values != grouped.sort(-1).values).any()


def test_blocks_are_rows_own():
    """Rows of a forward are routed as their own blocks: a row's experts do not depend on which
    rows share its forward, and a row that is not whole blocks wide is refused."""
    r = _router(capacity=6)
    x = torch.randn(3, 16, 24, generator=torch.Generator().manual_seed(4))
    together = r(x.reshape(-1, 24), 16)[0].view(3, 16, -1)
    for i in range(3):
        assert torch.equal(together[i], r(x[i], 16)[0])
    with pytest.raises(ValueError, match="whole 8-token blocks"):
        r(torch.randn(12, 24), 12)


def test_capacity_must_hold_top_k():
    with pytest.raises(ValueError, match="expert_capacity"):
        _router(capacity=2, k=4)


def test_a_checkpoints_layers_route_as_released(tmp_path):
    """The loaded tiny LLaDA2.2 checkpoint: every MoE layer's gate equals the transcription over a
    two-block window, and the MoE forward splits its (B, L, D) input into rows' blocks."""
    folder = write_llada22_checkpoint(tmp_path / "m", seed=5)
    model = load_model(folder, dtype="float32")
    assert model.cfg.arch == "llada2.2"
    assert (model.cfg.expert_capacity, model.cfg.routing_block) == (4, 32)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert moes
    h = torch.randn(2, 32, model.cfg.d_model, generator=torch.Generator().manual_seed(6))
    for m in moes:
        got = m.gate(h.reshape(-1, h.shape[-1]), 32)
        ref = block_routed_gate(h.reshape(-1, h.shape[-1]), m.gate.weight, m.gate.expert_bias, 32,
                                LLADA22_KEYS["expert_capacity"], model.cfg.experts_per_token, m.gate.scaling)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
