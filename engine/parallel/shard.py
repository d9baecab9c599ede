"""One rank's slice of a checkpoint, read straight from safetensors (never the whole tensor).

Megatron's split: q/k/v and the MLP's gate/up are column-parallel (rows of the weight, i.e.
output features: whole heads, grouped-query attention split by key/value heads so each rank's
query heads find their key/value heads locally; with fewer key/value heads than ranks, each
rank holds the one head its queries use, replicated as vLLM does), the attention output and MLP down projections
are row-parallel (input columns; their outputs are partial sums that `transformer.Block` all-reduces,
and a bias is added by rank 0 only). Embedding and output head are split by vocabulary rows.
Under tensor parallelism every expert is split like a dense MLP; under expert parallelism
each rank holds E/N whole experts and the shared expert whole. Norms and the router are
replicated. Every tensor is read with `safe_open(...).get_slice`, so a rank's memory holds its
slice only.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from celeris.engine.config import ModelConfig
from celeris.engine.models.transformer import MaskPredictor
from celeris.engine.models.moe import MoE, SwiGLU
from celeris.engine.parallel.group import Group, Plan, check_sizes
from celeris.engine.models.checkpoint import StrictState, checkpoint_folder, resolve_dtype, tensors
from celeris.engine.models.weights import Checkpoint, checkpoint_parts, router_bias, skip_meta_init

COLUMN, KV, ROW, RANK0, WHOLE = "column", "kv", "row", "rank0", "whole"
_EXPERT = re.compile(r"^(transformer\.blocks\.\d+\.mlp\.experts\.)(\d+)(\..*)$")
_RULES = [  # (pattern on our names, how the tensor splits); the first match wins
    (r"\.mlp\.gate\.", WHOLE),
    (r"\.mlp\.(experts\.\d+|shared_experts)\.(ff_proj|up_proj)\.weight$", COLUMN),
    (r"\.mlp\.(experts\.\d+|shared_experts)\.ff_out\.weight$", ROW),
    (r"^transformer\.(wte|ff_out)\.weight$", COLUMN),
    (r"\.q_proj\.(weight|bias)$", COLUMN),
    (r"\.(k_proj|v_proj)\.(weight|bias)$", KV),
    (r"\.attn_out\.weight$", ROW),
    (r"\.attn_out\.bias$", RANK0),
    (r"^transformer\.blocks\.\d+\.(ff_proj|up_proj)\.weight$", COLUMN),
    (r"^transformer\.blocks\.\d+\.ff_out\.weight$", ROW),
]


def shard_config(cfg: ModelConfig, plan: Plan) -> ModelConfig:
    """The shapes of one rank's slice (the model's other settings unchanged)."""
    n = plan.size
    return replace(cfg, n_heads=cfg.n_heads // n, n_kv_heads=max(1, cfg.n_kv_heads // n),
                   explicit_head_dim=cfg.head_dim,
                   mlp_hidden_size=cfg.mlp_hidden_size // n, embedding_size=cfg.embedding_size // n,
                   vocab_size=cfg.embedding_size // n,
                   moe_hidden_size=cfg.moe_hidden_size if plan.expert_parallel else cfg.moe_hidden_size // n)


def how(name: str, plan: Plan) -> str:
    """How our parameter `name` splits under `plan`."""
    if plan.expert_parallel and (".mlp.experts." in name or ".mlp.shared_experts." in name):
        return WHOLE  # whole experts (chosen by index), the shared expert on every rank
    for pattern, kind in _RULES:
        if re.search(pattern, name):
            return kind
    return WHOLE


def _read(f, ckpt_name: str, kind: str, rank: int, n: int, rows: Optional[tuple[int, int]] = None,
          kv_heads: int = 1) -> torch.Tensor:
    """This rank's part of a checkpoint tensor; `rows` first narrows it (a fused q/k/v part)."""
    sl = f.get_slice(ckpt_name)
    shape = sl.get_shape()
    lo, hi = rows or (0, shape[0])
    if kind == KV and kv_heads < n:  # fewer kv heads than ranks: the one head this rank's queries use
        dh, head = (hi - lo) // kv_heads, rank // (n // kv_heads)
        return sl[lo + head * dh: lo + (head + 1) * dh]
    if kind == KV:
        kind = COLUMN
    if kind == COLUMN:
        step = (hi - lo) // n
        return sl[lo + rank * step: lo + (rank + 1) * step]
    if kind == ROW:
        step = shape[1] // n
        return sl[lo:hi, rank * step:(rank + 1) * step]
    t = sl[lo:hi]
    return t if kind == WHOLE or rank == 0 else torch.zeros_like(t)


def _local_expert(name: str, cfg: ModelConfig, plan: Plan, rank: int) -> Optional[str]:
    """Under expert parallelism: an expert's name renumbered among this rank's, None if not ours."""
    m = _EXPERT.match(name)
    if m is None or not plan.expert_parallel:
        return name
    per = cfg.num_experts // plan.size
    e = int(m.group(2)) - rank * per
    return f"{m.group(1)}{e}{m.group(3)}" if 0 <= e < per else None


def checkpoint_parameters(folder: str | Path) -> int:
    """Parameters of the whole model, from the safetensors headers (no tensor is read); the
    router's expert_bias is a buffer, not a parameter, as `transformer.count_parameters` counts."""
    return sum(math.prod(f.get_slice(name).get_shape()) for name, _, f in tensors(folder)
               if not name.endswith("expert_bias"))


def _build(cfg: ModelConfig, plan: Plan, rank: int) -> MaskPredictor:
    with torch.device("meta"), skip_meta_init():
        model = MaskPredictor(cfg, shard_config(cfg, plan))
        if plan.expert_parallel:
            per = cfg.num_experts // plan.size
            for m in model.modules():
                if isinstance(m, MoE):
                    m.experts = nn.ModuleList(SwiGLU(cfg.d_model, cfg.moe_hidden_size) for _ in range(per))
                    m.expert_parallel, m.first_expert = True, rank * per
    return model


def load_shard(ckpt: Checkpoint, plan: Plan, group: Group, dtype: str | torch.dtype = "float32",
               device: str = "cpu") -> MaskPredictor:
    """Rank `group.rank`'s slice of the checkpoint in `folder`, wired to `group`'s collectives."""
    folder, cfg = checkpoint_folder(ckpt.folder), ckpt.cfg
    check_sizes(cfg, plan)
    rank, n, torch_dtype = group.rank, plan.size, resolve_dtype(dtype)
    model = _build(cfg, plan, rank)

    def convert(name: str, t: torch.Tensor) -> torch.Tensor:
        # A copy: a view would keep the whole file mapped (and its touched pages resident).
        if name.endswith("expert_bias"):
            return router_bias(t, torch_dtype).to(device=device, dtype=torch.float32, copy=True)
        return t.to(device=device, dtype=torch_dtype, copy=True)

    state = StrictState(folder, {name: p.shape for name, p in model.state_dict().items()}, convert)
    for ckpt_name, path, f in tensors(folder):
        for name, rows in checkpoint_parts(ckpt_name, f, cfg, ckpt.tensor_name):
            local = _local_expert(name, cfg, plan, rank)
            if local is None:  # an expert another rank holds
                continue
            state.expect(local, ckpt_name, path)  # before its slice is cut: an unknown tensor may not split
            state.put(local, _read(f, ckpt_name, how(name, plan), rank, n, rows, cfg.n_kv_heads), ckpt_name, path)
    model.load_state_dict(state.done(), strict=True, assign=True)
    for m in model.modules():
        if hasattr(m, "tp"):
            m.tp = group
    return model.eval().requires_grad_(False)
