"""One rank's view of the tensor-parallel group: the sizes it may take and its collectives.

Megatron-style sharding needs three collectives: an all-reduce after each row-parallel
projection, a masked lookup + all-reduce for the vocabulary-parallel embedding, and an
all-gather of each rank's vocabulary slice of the logits. gloo on CPU, NCCL on CUDA; every
collective runs under the group's timeout, so a hung rank ends in an error, not a hang.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from celeris.engine.config import ModelConfig
from celeris.engine.errors import ModelLoadError


@dataclass(frozen=True)
class Plan:
    """How a model is split: `size` ranks; experts whole per rank (`expert_parallel`) or sliced."""

    size: int = 1
    expert_parallel: bool = False


def check_sizes(cfg: ModelConfig, plan: Plan) -> None:
    """Refuse a size that does not divide what it must split, naming the quantity."""
    n = plan.size
    if n < 1:
        raise ModelLoadError(f"tensor parallel size must be >= 1, got {n}")
    if plan.expert_parallel and not cfg.num_experts:
        raise ModelLoadError("--expert-parallel needs a mixture-of-experts model; this one has no experts")
    if plan.expert_parallel and n == 1:
        raise ModelLoadError("--expert-parallel splits experts over the tensor-parallel ranks: set "
                             "--tensor-parallel-size to 2 or more")
    checks = [("attention heads", cfg.n_heads), ("vocabulary (embedding rows)", cfg.embedding_size)]
    if not cfg.num_experts or cfg.first_dense_layers:  # some layer has a dense MLP
        checks.append(("MLP hidden size", cfg.mlp_hidden_size))
    if cfg.num_experts:
        checks.append(("experts", cfg.num_experts) if plan.expert_parallel
                      else ("expert hidden size", cfg.moe_hidden_size))
    for what, value in checks:
        if value % n:
            raise ModelLoadError(f"tensor parallel size {n} does not divide the {what} ({value})")
    if cfg.n_kv_heads % n and n % cfg.n_kv_heads:  # fewer kv heads than ranks: each is replicated
        raise ModelLoadError(f"tensor parallel size {n} neither divides nor is a multiple of the key/value heads "
                             f"({cfg.n_kv_heads})")


class Group:
    """This rank's collectives over the model's process group."""

    def __init__(self, rank: int, size: int, pg=None):
        self.rank, self.size, self.pg = rank, size, pg  # pg: the process group (None: the default)

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's `partial` (same shape everywhere), in place."""
        dist.all_reduce(partial, group=self.pg)
        return partial

    def gather_last(self, part: torch.Tensor) -> torch.Tensor:
        """Every rank's `part` (..., n) concatenated in rank order along the last dim: (..., size*n)."""
        part = part.contiguous()
        parts = [torch.empty_like(part) for _ in range(self.size)]
        dist.all_gather(parts, part, group=self.pg)
        return torch.cat(parts, dim=-1)

    def embed(self, wte: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: this rank's rows give their tokens' vectors and zeros
        elsewhere; the all-reduce adds exactly one non-zero term per token, so it is exact."""
        rows = wte.weight.shape[0]
        local = ids - self.rank * rows  # (B, L)
        inside = (local >= 0) & (local < rows)
        x = wte(local.clamp(0, rows - 1)).masked_fill(~inside[..., None], 0)  # (B, L, D)
        return self.all_reduce(x)


def leader_store(size: int, start_timeout_s: float) -> dist.TCPStore:
    """The rendezvous store, served by rank 0 on a free loopback port (`.port`)."""
    return dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=start_timeout_s))


def worker_store(port: int, size: int, start_timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, size, is_master=False,
                         timeout=datetime.timedelta(seconds=start_timeout_s))


def init_group(rank: int, size: int, store: dist.Store, backend: str, timeout_s: float) -> Group:
    """Join the group through `store` as `rank` of `size`. The model's collectives run in a
    group of their own whose timeout is `timeout_s`."""
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    pg = dist.new_group(list(range(size)), timeout=datetime.timedelta(seconds=timeout_s))
    return Group(rank, size, pg)


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"
