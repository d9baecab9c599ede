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

from typing import Optional

import torch

from celeris.engine.config import ModelConfig
from celeris.engine.model import KVCache

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


class BlockKVStore(KVCacheStore):
    """The exact cache of block-diffusion models: per slot, the keys/values of every committed
    block at its absolute column (left-aligned, column = position), written once per block."""

    def read_prefix(self, rows: torch.Tensor, Lc: int, scratch: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of columns [0, Lc) of `rows`, followed by `scratch` zero columns where padded
        fresh positions can land without being attended."""
        def read(t: torch.Tensor) -> torch.Tensor:
            part = t[rows, :, :Lc]
            return torch.cat([part, part.new_zeros(*part.shape[:2], scratch, part.shape[3])], dim=2)

        return [read(k) for k in self.keys], [read(v) for v in self.values]

    def write_columns(self, slots: torch.Tensor, cols: torch.Tensor, rows: torch.Tensor, width_index: torch.Tensor,
                      kvs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """keys[layer][slots[m], :, cols[m]] = fresh[layer][rows[m], :, width_index[m]] for every m."""
        for layer, (k, v) in enumerate(kvs):
            self.keys[layer][slots, :, cols] = k[rows, :, width_index]
            self.values[layer][slots, :, cols] = v[rows, :, width_index]
