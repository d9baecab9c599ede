"""One rank's slice of a checkpoint, read straight from safetensors (never the whole tensor).

Megatron's split: q/k/v and the MLP's gate/up are column-parallel (rows of the weight, i.e.
output features: whole heads, grouped-query attention split by key/value heads so each rank's
query heads find their key/value heads locally; with fewer key/value heads than ranks, each
rank holds the one head its queries use, replicated as vLLM does), the attention output and MLP down projections
are row-parallel (input columns; their outputs are partial sums that `model.Block` all-reduces,
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
from safetensors import safe_open
from torch import nn

from celeris.engine.config import ModelConfig
from celeris.engine.errors import ModelLoadError
from celeris.engine.models.transformer import MaskPredictor
from celeris.engine.models.moe import MoE, SwiGLU
from celeris.engine.parallel.group import Group, Plan, check_sizes
from celeris.engine.models.weights import _tensor_files, canonical_name, resolve_dtype, router_bias, skip_meta_init

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


def _parts(ckpt_name: str, cfg: ModelConfig) -> list[tuple[str, Optional[tuple[int, int]]]]:
    """Our names of a checkpoint tensor with their row ranges: LLaDA2's fused query_key_value
    is three tensors ([q heads | k heads | v heads] rows), every other tensor one."""
    name = canonical_name(ckpt_name)
    m = re.match(r"^transformer\.blocks\.(\d+)\.attention\.query_key_value\.(weight|bias)$", name)
    if m is None:
        return [(name, None)]
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    bounds = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
    return [(f"transformer.blocks.{m.group(1)}.{p}_proj.{m.group(2)}", bounds[p]) for p in "qkv"]


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
    router's expert_bias is a buffer, not a parameter, as `model.count_parameters` counts."""
    total = 0
    for path in set(_tensor_files(Path(folder)).values()):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if not name.endswith("expert_bias"):
                    total += math.prod(f.get_slice(name).get_shape())
    return total


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


def load_shard(folder: str | Path, plan: Plan, group: Group, dtype: str | torch.dtype = "float32",
               device: str = "cpu") -> MaskPredictor:
    """Rank `group.rank`'s slice of the checkpoint in `folder`, wired to `group`'s collectives."""
    folder = Path(folder)
    cfg = ModelConfig.from_dir(folder)
    check_sizes(cfg, plan)
    rank, n, torch_dtype = group.rank, plan.size, resolve_dtype(dtype)
    model = _build(cfg, plan, rank)
    expected = {name: p.shape for name, p in model.state_dict().items()}
    by_file: dict[Path, list[str]] = {}
    for ckpt_name, path in _tensor_files(folder).items():
        by_file.setdefault(path, []).append(ckpt_name)
    state: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with safe_open(path, framework="pt", device="cpu") as f:
            for ckpt_name in names:
                for name, rows in _parts(ckpt_name, cfg):
                    local = _local_expert(name, cfg, plan, rank)
                    if local is None:
                        continue
                    if local not in expected:
                        raise ModelLoadError(f"unexpected tensor {ckpt_name!r} in {path.name}")
                    t = _read(f, ckpt_name, how(name, plan), rank, n, rows, cfg.n_kv_heads)
                    if tuple(t.shape) != tuple(expected[local]):
                        raise ModelLoadError(f"tensor {ckpt_name!r} in {path.name}: shard shape {tuple(t.shape)}, "
                                             f"expected {tuple(expected[local])}")
                    if local.endswith("expert_bias"):
                        t = router_bias(t, torch_dtype)
                    # A copy: a view would keep the whole file mapped (and its touched pages resident).
                    state[local] = t.to(device=device, dtype=torch.float32 if local.endswith("expert_bias")
                                        else torch_dtype, copy=True)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelLoadError(f"missing tensor(s) in {folder}: {', '.join(missing[:5])}")
    model.load_state_dict(state, strict=True, assign=True)
    for m in model.modules():
        if hasattr(m, "tp"):
            m.tp = group
    return model.eval().requires_grad_(False)
