"""DiffusionGemma's routed experts, as transformers' default experts forward (`grouped_mm`) runs them,
for one request or several in one forward (rows.py: which rows may share an expert's matmul)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from celeris.engine.families.revise.config import GemmaConfig
from celeris.engine.families.revise.rows import ExpertRoute, Packed, expert_route, gelu, per_request


def unreduced(x: torch.Tensor) -> torch.Tensor:
    """One process: a row-parallel output is whole already (revise/parallel.py sets the all-reduce)."""
    return x


class Experts(nn.Module):
    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(cfg.num_experts, 2 * cfg.moe_hidden_size, cfg.d_model))
        self.down_proj = nn.Parameter(torch.zeros(cfg.num_experts, cfg.d_model, cfg.moe_hidden_size))
        self.n_experts = cfg.num_experts  # the router's choice; this rank may hold fewer (below)
        # Parallel ranks (revise/parallel.py): under expert parallelism this rank holds experts
        # [first, first + its count) and computes only the pairs routed to them; either way its output
        # is a partial sum, all-reduced.
        self.first = 0
        self.reduce = unreduced

    def forward(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, rows: Packed) -> torch.Tensor:
        """Each token's k experts, weighed and summed over its k slots in slot order.  x: (N, D), w and
        idx: (N, k) -> (N, D)

        As transformers' default experts forward (`grouped_mm`): the (token, slot) pairs sorted by
        expert, one grouped matmul per projection (each expert's matmul over the rows routed to it),
        then each token's k outputs summed. Several requests' rows (`rows`) are routed as each is alone
        and share an expert's matmul only where that keeps their bits (rows.py: `expert_route`)."""
        N, k = idx.shape
        route = expert_route(idx, rows, self.n_experts)
        pairs = Packed(tuple(n * k for n in rows.lengths))  # each request's pairs, request after request
        gate_up = _grouped(x[route.order // k], self.gate_up_proj, route, self.first)  # (N*k, 2I) request-major
        act = per_request(pairs, _gated, gate_up)  # (N*k, I)
        y = _grouped(act, self.down_proj, route, self.first) * w.reshape(-1)[route.order, None]  # (N*k, D)
        out = torch.empty_like(y)
        out[route.order] = y  # back to (token, slot) order
        return self.reduce(out.view(N, k, -1).sum(dim=1)).to(x.dtype)


def _gated(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate) * up of one request's pairs.  (P, 2I) -> (P, I)"""
    gate, up = gate_up.chunk(2, dim=-1)
    return gelu(gate) * up


def _grouped(x: torch.Tensor, weight, route: ExpertRoute, first: int = 0) -> torch.Tensor:
    """`grouped_linear` over the route's passes, each pass's rows written back where they came from.
    x: (P, D) in the route's order -> (P, F)"""
    (positions, counts), *more = route.passes
    if positions is None:
        return _held(x, weight, counts, first)
    head = _held(x[positions], weight, counts, first)
    out = head.new_empty(x.shape[0], head.shape[1])
    out[positions] = head
    for positions, counts in more:
        out[positions] = _held(x[positions], weight, counts, first)
    return out


def _held(x: torch.Tensor, weight, counts: torch.Tensor, first: int) -> torch.Tensor:
    """`grouped_linear` over the experts this rank holds, [first, first + weight.shape[0]) of the
    router's (E,) `counts`; the rows of experts held elsewhere (expert parallelism) come out zero.
    Their rows are one run, as the rows are sorted by expert (one host read of where it lies).
    x: (M, D) -> (M, F)"""
    held = weight.shape[0] if isinstance(weight, torch.Tensor) else counts.shape[0]
    if held == counts.shape[0]:
        return grouped_linear(x, weight, counts)
    lo = int(counts[:first].sum())
    hi = lo + int(counts[first:first + held].sum())
    out = x.new_zeros(x.shape[0], weight.shape[1])
    out[lo:hi] = grouped_linear(x[lo:hi], weight, counts[first:first + held])
    return out


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Consecutive runs of rows, run e through F.linear(rows, weight[e]).  x: (M, D), weight (E, F, D),
    counts (E,) summing to M -> (M, F). torch's grouped matmul does the loop in one call (on the CPU
    it is one mm per group: bit-equal to F.linear over the same rows); older torch loops here. A weight
    packed to FP8 (engine/models/fp8.py's Fp8Grouped, `--quantization fp8`) runs its own grouped matmul."""
    if not isinstance(weight, torch.Tensor):
        return weight.grouped_linear(x, counts)
    if hasattr(torch, "_grouped_mm") and (x.device.type == "cpu" or x.dtype == torch.bfloat16):  # CUDA's: bf16
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=counts.cumsum(0).to(torch.int32))
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        out.append(F.linear(x[start:start + n], weight[e]))
        start += n
    return torch.cat(out)
