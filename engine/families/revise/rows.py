"""Several DiffusionGemma requests in one forward, each row computed as it is alone (issue 62).

A forward packs its requests' tokens one after another: request r owns rows [start_r, start_r + T_r)
of a (1, N, D) tensor (`Packed`). Every GEMM then runs over the whole pack, and a row keeps the bits
it gets alone because of what the CPU's float32 GEMM promises under MKL's strict reproducibility mode
(`MKL_CBWR`, set by celeris.engine; docs/architecture.md, "Batch invariance (CPU)"): a row rounds the
same in any GEMM of at least `ROW_ALIGN` rows, wherever it sits (measured here, AMD AVX2, torch 2.13:
1-300 rows, 1 and 2 threads, 32-4,096 wide; on an AVX-512 Intel host every row count agrees). Below
ROW_ALIGN rows MKL picks another kernel, so what would run that small alone runs that small here too:

- a request of fewer than ROW_ALIGN tokens (a short prompt, a canvas shorter than ROW_ALIGN) gets a
  forward of its own (`packs`);
- an expert that a request routes fewer than ROW_ALIGN of its (token, slot) pairs to runs those rows
  in a grouped matmul of their own, in the request's own order (`expert_passes`); the experts' other
  rows, from every request, share one.

What is not a GEMM is made per request where the batch could change its bits: attention (each
request reads its own cache: `DiffusionGemma` loops over the pack's requests), and the tanh form of
GELU, whose vectorised and scalar loops round differently, so where a tensor's tail falls (its size,
the thread split) changes a row's bits (`gelu_rows` runs it on each request's own slice, the very
shape and strides it has alone). Reductions over the last dimension (RMS norms, softmax) and the sum
over an expert's k slots round each row alike at any row count (measured). On CUDA nothing of this
holds (cuBLAS picks kernels by shape): there each request keeps a forward of its own unless the
server asks for the shared one (`shared_forward`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

ROW_ALIGN = 4  # the fewest GEMM rows at which MKL's strict mode rounds a row as in any larger GEMM


@dataclass(frozen=True)
class Packed:
    """Which rows of a forward's (1, N, ...) tensors belong to which request, in order."""

    lengths: tuple[int, ...]  # (R,) tokens of each request

    @property
    def starts(self) -> tuple[int, ...]:
        out, s = [], 0
        for n in self.lengths:
            out.append(s)
            s += n
        return tuple(out)

    def split(self, x: torch.Tensor, dim: int = 1) -> tuple[torch.Tensor, ...]:
        """Each request's rows of x, views along `dim`."""
        return x.split(list(self.lengths), dim=dim)


def packs(lengths: list[int], shared: bool) -> list[list[int]]:
    """Which requests share a forward: every request of at least ROW_ALIGN tokens in one, each shorter
    one alone (its GEMMs must run as small as they run alone); each alone when not `shared`."""
    if not shared:
        return [[r] for r in range(len(lengths))]
    big = [r for r, n in enumerate(lengths) if n >= ROW_ALIGN]
    return ([big] if big else []) + [[r] for r, n in enumerate(lengths) if n < ROW_ALIGN]


def gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def gelu_rows(x: torch.Tensor, rows: Packed, dim: int = 1) -> torch.Tensor:
    """GELU (tanh form) of x, each request's slice on its own: the same bits as alone (module notes)."""
    if len(rows.lengths) == 1:
        return gelu(x)
    out = torch.empty_like(x)
    for part, o in zip(rows.split(x, dim), rows.split(out, dim)):
        o.copy_(gelu(part))
    return out


def per_request(rows: Packed, fn: Callable[[torch.Tensor], torch.Tensor], *xs: torch.Tensor,
                dim: int = 0) -> torch.Tensor:
    """fn over each request's slices of xs (along `dim`), concatenated: an op whose rounding would
    follow the batch, run on each request's own rows."""
    if len(rows.lengths) == 1:
        return fn(*xs)
    return torch.cat([fn(*parts) for parts in zip(*(rows.split(x, dim) for x in xs))], dim=dim)


@dataclass(frozen=True)
class ExpertRoute:
    """A pack's (token, slot) pairs sorted by expert within each request, as each sorts them alone.

    `order` (P,): the pairs (indices into the (N * k,) token-major flattening of the router's choice),
    request after request, each request's pairs sorted with torch.sort as the reference sorts them (a
    row's place in a small group changes its bits). `passes`: the grouped matmuls that cover them,
    each (positions into `order` (M,), rows per expert (E,))."""

    order: torch.Tensor
    passes: tuple[tuple[Optional[torch.Tensor], torch.Tensor], ...]  # positions None: all of `order`


def expert_route(idx: torch.Tensor, rows: Packed, n_experts: int) -> ExpertRoute:
    """Route a pack's tokens.  idx (N, k) expert ids -> ExpertRoute"""
    k = idx.shape[1]
    orders, counts = [], []
    for start, part in zip(rows.starts, rows.split(idx, 0)):
        flat = part.reshape(-1)  # (T * k,) token-major
        orders.append(torch.sort(flat).indices + start * k)
        c = torch.zeros(n_experts, dtype=torch.long, device=idx.device)
        counts.append(c.index_add_(0, flat, torch.ones_like(flat)))  # not bincount: no host sync on a device
    if len(counts) == 1:  # one request: one grouped matmul, exactly as alone
        return ExpertRoute(orders[0], ((None, counts[0]),))
    return ExpertRoute(torch.cat(orders), expert_passes(torch.stack(counts)))


def expert_passes(counts: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Grouped matmuls covering every request's rows of every expert, in as few passes as the rule
    allows: per expert, the rows of every request that routes at least ROW_ALIGN pairs to it share one
    group (pass 0); a request's smaller group gets a pass of its own (the expert's next free one).
    counts (R, E): pairs each request routes to each expert -> per pass (positions (M,), counts (E,)),
    positions indexing the request-major sorted pairs (`ExpertRoute.order`), expert after expert."""
    R, E = counts.shape
    flat = counts.reshape(-1)
    start = (flat.cumsum(0) - flat).view(R, E)  # (R, E) where each group begins in the request-major order
    small = (counts > 0) & (counts < ROW_ALIGN)
    big = counts >= ROW_ALIGN
    unit = torch.where(big, 0, big.any(0, keepdim=True).long() + small.long().cumsum(0) - 1)  # (R, E) pass
    out = []
    for p in range(int(unit.masked_fill(counts == 0, -1).max()) + 1):
        chosen = ((unit == p) & (counts > 0)).T  # (E, R): expert-major, then request order
        sizes, firsts = counts.T[chosen], start.T[chosen]  # (G,) each
        total = int(sizes.sum())
        ends = sizes.cumsum(0)
        positions = torch.arange(total, device=counts.device) + torch.repeat_interleave(firsts - (ends - sizes), sizes)
        out.append((positions, (counts * chosen.T).sum(0)))
    return tuple(out)
