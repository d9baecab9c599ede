"""Block-wise approximate KV cache (Fast-dLLM), one preallocated buffer per layer.

Keys/values live per slot, right-aligned exactly like the runner's canvas buffer, and are
rotated with positions counted from the row's first real token, so a row's cache is valid in
any batch length.

- prefix: at a block's first step the whole canvas is run and its K/V stored; later steps of
  the block recompute the block and everything after it, attending to the cached prefix.
- dual: later steps recompute only the block; prefix and suffix K/V both come from the cache.

A cached step attends over the row's whole context in canvas order, the fresh keys written
over the cached ones at their columns, exactly as Fast-dLLM replaces them.

The cache is refreshed at every block boundary, which bounds how stale it can get.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from celeris.engine.config import ModelConfig
from celeris.engine.models.transformer import KVCache

class KVCacheStore:
    def __init__(self, cfg: ModelConfig, rows: int, max_len: int, device: torch.device, dtype: torch.dtype):
        shape = (rows, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.max_len = max_len

    def write(self, rows: torch.Tensor, kvs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Store a full forward's K/V (each (B, Hk, L, Dh), the buffer's last L columns)."""
        L = kvs[0][0].shape[2]
        for layer, (k, v) in enumerate(kvs):
            self.keys[layer][rows, :, self.max_len - L:] = k
            self.values[layer][rows, :, self.max_len - L:] = v

    def read(self, rows: torch.Tensor, L: int, key_mask: Optional[torch.Tensor], fresh: torch.Tensor) -> KVCache:
        """The cached context of `rows` over the last L columns (a copy); key_mask (B, L) marks
        padding (None: none); fresh (B, F) the columns the forward recomputes."""
        keys = [k[rows, :, self.max_len - L:] for k in self.keys]
        values = [v[rows, :, self.max_len - L:] for v in self.values]
        return KVCache(keys, values, key_mask, fresh)


@dataclass
class CanvasCache:
    """One cached full-canvas forward's view of a `KVCacheStore`: the fresh keys/values are
    written in place at their columns of each row's slot (every cached step of a block recomputes
    those columns, and the next block's store step rewrites the whole row, so nothing stale is
    ever read), and attention reads the rows' last L columns: on the CPU (`rows`: the slots as
    host ints, with padding) as views of the store, one row at a time; else one gather per layer."""

    store: KVCacheStore
    slots: torch.Tensor  # (B,)
    fresh: torch.Tensor  # (B, F) batch columns (of the last L) of the fresh positions
    L: int
    key_mask: Optional[torch.Tensor]  # (B, L) False at padding; None when there is none
    rows: Optional[list[int]] = None

    def attach(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        K, V = self.store.keys[layer], self.store.values[layer]
        first = self.store.max_len - self.L
        K[self.slots[:, None], :, first + self.fresh] = k.transpose(1, 2)  # (B, F, Hk, Dh) at (slot, col)
        V[self.slots[:, None], :, first + self.fresh] = v.transpose(1, 2)
        if self.rows is not None and self.key_mask is not None:
            return [K[s:s + 1, :, first:] for s in self.rows], [V[s:s + 1, :, first:] for s in self.rows]
        return K[:, :, first:].index_select(0, self.slots), V[:, :, first:].index_select(0, self.slots)


class BlockKVStore(KVCacheStore):
    """The exact cache of block-diffusion models: per slot, the keys/values of every committed
    block at its absolute column (left-aligned, column = position). A forward writes its fresh
    keys/values in place at their columns (a block's provisional ones are rewritten by its
    store step; a prefill's are final), and attention reads each row's prefix where it lies:
    no per-layer gather, concatenation or scatter into a copy. Columns [max_len, width) are
    scratch where padded fresh positions land, one column each, never attended."""

    def __init__(self, cfg: ModelConfig, rows: int, max_len: int, device: torch.device, dtype: torch.dtype,
                 scratch: int = 0):
        super().__init__(cfg, rows, max_len + scratch, device, dtype)
        self.max_len, self.width = max_len, max_len + scratch


@dataclass
class BlockCache:
    """One forward's view of a `BlockKVStore`: row b's fresh keys/values go to
    (slots[b], cols[b, j]). `rows` (host ints, one per row: its slot and key end) selects the
    per-row path, which attends over views of the store; None selects the static-shape path,
    which reads the first `length` columns of every row at once (what a CUDA graph captures)."""

    store: BlockKVStore
    slots: torch.Tensor  # (B,)
    cols: torch.Tensor  # (B, F)
    length: int  # keys each row of the static path reads (a fixed bucket, so rows are batch-invariant)
    rows: Optional[list[tuple[int, int]]] = None
    key_mask = None  # (the model's forward reads it from any cache)

    def attach(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write the fresh k, v (B, Hk, F, Dh) in place; return what attention reads: per-row
        views (1, Hk, end, Dh) or the static (B, Hk, length, Dh)."""
        K, V = self.store.keys[layer], self.store.values[layer]
        K[self.slots[:, None], :, self.cols] = k.transpose(1, 2)  # (B, F, Hk, Dh) at (slot, col)
        V[self.slots[:, None], :, self.cols] = v.transpose(1, 2)
        if self.rows is not None:
            return [K[s:s + 1, :, :e] for s, e in self.rows], [V[s:s + 1, :, :e] for s, e in self.rows]
        return K[:, :, :self.length].index_select(0, self.slots), V[:, :, :self.length].index_select(0, self.slots)
