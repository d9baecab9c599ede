"""Mixture-of-experts feed-forward (LLaDA2.x): a grouped sigmoid router, routed and shared experts.

Router (as LLaDA2's published gate): scores = sigmoid(h W^T) in float32; the choice uses
scores + expert_bias (load balancing without an auxiliary loss): each of `n_group` contiguous
groups of experts scores the sum of its two best, the best `topk_group` groups stay, and the
`top_k` best experts among them are chosen. Their weights are the unbiased scores, normalised
to sum to one when top_k > 1, times `routed_scaling_factor`. The output is the weighted sum of
the chosen experts plus the shared expert(s), which every token passes through.

Block routing (LLaDA2.2, `expert_capacity` > 0): the group fields are ignored; each run of
`routing_block` consecutive tokens of a row (one diffusion block) scores every expert by its best
biased score over the block, keeps its top `expert_capacity`, and each token then takes its top_k
among those. The blocks are rows' own: a forward's rows must be whole blocks wide (the block
runner's parts are), so which rows share a forward never changes a token's experts.

The forward is batched over tokens: one loop over the experts that received any token, each a
gather and one SwiGLU over its tokens (no Python loop over tokens); the k outputs of a token
are weighed and summed in float32. That loop is data-dependent; with `static` (and always
inside a CUDA graph capture) every expert runs over every token instead, masked by the routing.
Shapes: N tokens, D model width, E experts, k experts per token, I expert width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from celeris.engine.config import ModelConfig


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); parameter names as the dense blocks' (ff_proj, up_proj, ff_out)."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.ff_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.ff_out = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff_out(F.silu(self.ff_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.d_model))
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts))
        self.top_k, self.n_group, self.topk_group = cfg.experts_per_token, cfg.n_group, cfg.topk_group
        self.scaling = cfg.routed_scaling_factor
        self.capacity, self.routing_block = cfg.expert_capacity, cfg.routing_block
        if self.capacity:
            if not 0 < cfg.experts_per_token <= self.capacity <= cfg.num_experts or cfg.routing_block < 1:
                raise ValueError(f"block routing needs experts_per_token <= expert_capacity={self.capacity} <= "
                                 f"num_experts={cfg.num_experts} and a block size, got {cfg.routing_block}")
        elif cfg.num_experts % cfg.n_group or cfg.num_experts // cfg.n_group < 2:
            raise ValueError(f"num_experts={cfg.num_experts} must split into n_group={cfg.n_group} groups of >= 2")

    def forward(self, h: torch.Tensor, width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """h (N, D) -> expert ids (N, k), float32 weights (N, k). `width`: tokens per row of the
        forward (N when 0), which block routing splits into whole blocks."""
        scores = torch.sigmoid(F.linear(h.float(), self.weight.float()))  # (N, E)
        biased = scores + self.expert_bias.float()
        if self.capacity:
            idx = self._block_routed(biased, width or biased.shape[0])
        else:
            idx = self._grouped(biased)
        weights = scores.gather(1, idx)
        if self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, weights * self.scaling

    def _block_routed(self, biased: torch.Tensor, width: int) -> torch.Tensor:
        """Top-k per token among its block's top `capacity` experts (block = `routing_block`
        tokens of one row) -> (N, k)."""
        N, E = biased.shape
        if width % self.routing_block or N % width:
            raise ValueError(f"block routing needs rows of whole {self.routing_block}-token blocks, got rows of "
                             f"{width} tokens ({N} in all)")
        blocks = biased.view(-1, self.routing_block, E)  # (N / block, block, E)
        allowed = blocks.max(dim=1).values.topk(self.capacity, dim=-1).indices  # (N / block, capacity)
        keep = torch.zeros_like(blocks[:, 0], dtype=torch.bool).scatter_(1, allowed, True)  # (N / block, E)
        keep = keep[:, None, :].expand_as(blocks).reshape(N, E)
        return biased.masked_fill(~keep, float("-inf")).topk(self.top_k, dim=-1).indices

    def _grouped(self, biased: torch.Tensor) -> torch.Tensor:
        """LLaDA2.0's group-limited top-k -> (N, k)."""
        N, E = biased.shape
        per_group = E // self.n_group
        group_scores = biased.view(N, self.n_group, per_group).topk(2, dim=-1).values.sum(-1)  # (N, G)
        groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        keep = keep[:, :, None].expand(N, self.n_group, per_group).reshape(N, E)
        return biased.masked_fill(~keep, float("-inf")).topk(self.top_k, dim=-1).indices  # (N, k)


ROW_ALIGN = 4  # CPU GEMMs round a row alike at any row count that is a multiple of this


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """x (N, D) padded with zero rows to a multiple of ROW_ALIGN: an expert's rows then round
    the same whichever other tokens chose it (a prefix-cached prompt block's keys/values equal
    a cold prefill's, engine/models/prefix_cache.py); the padded rows are dropped."""
    pad = -x.shape[0] % ROW_ALIGN
    return x if not pad else torch.cat([x, x.new_zeros(pad, x.shape[1])])


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(SwiGLU(cfg.d_model, cfg.moe_hidden_size) for _ in range(cfg.num_experts))
        self.shared_experts = (SwiGLU(cfg.d_model, cfg.moe_hidden_size * cfg.num_shared_experts)
                               if cfg.num_shared_experts else None)
        # engine/parallel: `tp` the group; with `expert_parallel` this rank holds experts
        # [first_expert, first_expert + len(experts)) whole, else a hidden slice of every expert.
        self.tp, self.expert_parallel, self.first_expert = None, False, 0
        self.static = False  # every expert over every token, masked: static shapes (CUDA graphs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, D)
        idx, weights = self.gate(flat, shape[-2] if x.dim() > 2 else 0)  # (N, k)
        static = self.static or (flat.is_cuda and torch.cuda.is_current_stream_capturing())
        out = (self._every_expert if static else self._chosen_experts)(flat, idx)  # (N, k, D)
        if self.expert_parallel:  # each slot was filled by one rank, zeros elsewhere: an exact sum
            out = self.tp.all_reduce(out)
        # Weighed and summed over the k slots in float32, in slot order, as published.
        y = (out.float() * weights[..., None]).sum(dim=1).to(x.dtype)
        if self.shared_experts is not None:  # whole on every rank under expert parallelism
            y = y + self.shared_experts(flat)
        if self.tp is not None and not self.expert_parallel:  # hidden slices: partial sums
            y = self.tp.all_reduce(y)
        return y.view(shape)

    def _chosen_experts(self, flat: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Each token's k outputs (N, k, D), computing only the experts some token chose (and
        this rank holds): a data-dependent loop, one host read."""
        out = flat.new_zeros(flat.shape[0], idx.shape[1], flat.shape[-1])
        mine = range(self.first_expert, self.first_expert + len(self.experts))
        for e in torch.unique(idx).tolist():
            if e in mine:
                rows, slots = (idx == e).nonzero(as_tuple=True)
                out[rows, slots] = self.experts[e - self.first_expert](_aligned(flat[rows]))[:len(rows)]
        return out

    def _every_expert(self, flat: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The same (N, k, D) at static shapes: every expert this rank holds runs over every
        token and its rows are kept where the token chose it. E/k times the expert compute, no
        host read: what a graph captures at the few tokens of a denoise step (the bucket
        policy keeps larger forwards eager)."""
        out = flat.new_zeros(flat.shape[0], idx.shape[1], flat.shape[-1])
        for e, expert in enumerate(self.experts):
            chose = (idx == self.first_expert + e)[..., None]  # (N, k, 1)
            out = torch.where(chose, expert(flat)[:, None, :], out)
        return out
