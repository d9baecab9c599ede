"""scripts/benchmark.py's FLOP counter reads the key length of every cache a forward is given:
the full-canvas runner's cached steps pass a CanvasCache (a view of the slot store), which has no
`keys` (the first command of docs/benchmarks.md crashed on it after 4 minutes)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"


def _benchmark():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import benchmark
    finally:
        sys.path.remove(str(SCRIPTS))
    return benchmark


def test_key_length_of_each_cache_kind():
    from celeris.engine.models.cache import CanvasCache
    from celeris.engine.models.transformer import KVCache

    key_length = _benchmark().key_length
    assert key_length(8, None) == 8
    canvas = CanvasCache(store=None, slots=torch.zeros(2, dtype=torch.long), fresh=torch.zeros(2, 8, dtype=torch.long),
                         L=48, key_mask=None)
    assert key_length(8, canvas) == 48  # the slot's last L columns, the 8 fresh ones among them
    prefix = KVCache([torch.zeros(2, 4, 48, 16)], [torch.zeros(2, 4, 48, 16)], None, None)
    assert key_length(8, prefix) == 48  # the whole row: the fresh columns replace cached ones
