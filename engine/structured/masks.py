"""A step's token masks for its constrained rows (engine/structured/constraint.Constraint): the
packed rows llguidance writes, unpacked once for the whole step on the host or on the device."""

from __future__ import annotations

from typing import Any, Optional, Sequence as Seq

import numpy as np
import torch

from celeris.engine.errors import InvalidRequest
from celeris.engine.sampling.batch import Allowed

_BITS = torch.tensor([[(x >> j) & 1 for j in range(8)] for x in range(256)], dtype=torch.bool)  # (256, 8)


def unpack(words: np.ndarray, V: int, device: torch.device) -> torch.Tensor:
    """(N, ceil(V / 32)) uint32 packed bits -> (N, V) bool on `device`. Little-endian bytes: byte
    k holds tokens 8k..8k+7. On the host numpy unpacks them; for an accelerator the packed
    words cross (V / 8 bytes a row) and each byte is looked up in a (256, 8) table there."""
    if device.type == "cpu":
        return torch.from_numpy(np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :V].view(bool))
    packed = torch.from_numpy(words.view(np.uint8)).to(device, non_blocking=True)
    return _BITS.to(device)[packed.long()].flatten(1)[:, :V]


def window_masks(rows: Seq[Optional[tuple[Any, list[int]]]], W: int, device: torch.device):
    """A step's constrained rows as (front (B, W) bool: the columns that may commit, `Allowed`,
    failed {row: InvalidRequest}), or (None, None, {}) when no row is constrained: unconstrained
    batches pay nothing. rows[b] is (constraint, the canvas position of each window column, -1
    for none) or None (unconstrained: every column may commit). llguidance fills packed rows
    (one bit a token), unpacked once for the whole step (`unpack`). Each row's masks are built
    on their own: a row whose structure raises, or allows no token at a front, is in `failed`
    with no front (it commits nothing), and every other row's masks are as without it."""
    if all(r is None for r in rows):
        return None, None, {}
    B = len(rows)
    front = np.ones((B, W), dtype=bool)
    flat: list[int] = []
    packed: list[np.ndarray] = []
    failed: dict[int, InvalidRequest] = {}
    for b, r in enumerate(rows):
        if r is None:
            continue
        front[b] = False
        try:
            cols, words = r[0].window(r[1])
        except InvalidRequest as e:
            failed[b] = e
            continue
        front[b, cols] = True
        flat += [b * W + j for j in cols]
        packed.append(words)
    c = next(r[0] for r in rows if r is not None)
    words = np.concatenate(packed) if packed else np.zeros((0, c.words), dtype=np.uint32)
    return torch.from_numpy(front).to(device), Allowed(torch.tensor(flat, dtype=torch.long, device=device),
                                                       unpack(words, c.V, device)), failed
