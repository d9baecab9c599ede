"""The leader's side: a model and KV cache stores that replay every call on the workers.

The runners call the model and their KV cache store as on one device; `MirroredModel` and
`MirroredStore` first send each call's inputs (ids, positions, masks, spans, cache indices:
small host tensors) to every worker, then run the leader's own shard. Workers make the same
calls on their shards in the same order (engine/parallel/worker.py), so the collectives inside
the forward meet. Keys/values never travel: each rank keeps its own heads' cache, and a
store call's result (a read) or argument (the keys/values to write) is the rank's own.
Selection and sampling run on the leader only: the head's logits are gathered to every rank.
"""

from __future__ import annotations

import pickle
import threading
from dataclasses import replace
from typing import Callable, Optional

import torch
from torch import nn

from celeris.engine.models.cache import BlockCache, CanvasCache
from celeris.engine.errors import Unavailable
from celeris.engine.models.transformer import KVCache, MaskPredictor


class WorkerLost(Unavailable):
    """A tensor-parallel worker died or stopped answering: the model cannot run any more."""

    def __init__(self, message: str, rank: Optional[int] = None):
        super().__init__(message)
        self.rank = rank


def to_device(obj, device):
    """`obj` with every tensor inside (lists, tuples, dicts, dataclass spans) moved to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if hasattr(obj, "__dataclass_fields__") and getattr(obj, "allowed", None) is not None:
        return replace(obj, allowed=obj.allowed.to(device))
    return obj


def _timed_out(exc: BaseException) -> bool:
    return "timed out" in str(exc).lower() or "timeout" in str(exc).lower()


class Channel:
    """The leader's pipes to its workers, one per rank 1..N-1, and their liveness."""

    def __init__(self, conns: list, procs: list):
        self.conns, self.procs = conns, procs
        self.lost: Optional[WorkerLost] = None
        self.on_lost: list[Callable[[WorkerLost], None]] = []  # told once, from whichever thread saw it
        self._lock = threading.Lock()  # the watcher thread and the step thread may both see a loss

    def dead_ranks(self) -> list[int]:
        return [r for r, p in enumerate(self.procs, start=1) if not p.is_alive()]

    def fail(self, rank: Optional[int], why: str) -> WorkerLost:
        """Record the group as broken (once) and return the error every later call raises."""
        with self._lock:
            if self.lost is not None:
                return self.lost
            named = f"tensor-parallel worker rank {rank}" if rank is not None else "a tensor-parallel worker"
            self.lost = WorkerLost(f"{named} {why}; the model cannot run", rank)
        for fn in list(self.on_lost):
            fn(self.lost)
        return self.lost

    def unresponsive(self, wait_s: float = 2.0) -> list[int]:
        """Ranks alive that do not answer a ping: after a collective timed out, the healthy ranks
        have failed the same collective and exited, so the one left hanging is the culprit."""
        silent = []
        for rank, (conn, p) in enumerate(zip(self.conns, self.procs), start=1):
            p.join(timeout=wait_s)  # give the healthy ranks time to exit
            if not p.is_alive():
                continue
            try:
                conn.send_bytes(pickle.dumps(("ping", None)))
                if conn.poll(wait_s) and pickle.loads(conn.recv_bytes()) == "pong":
                    continue
            except (OSError, EOFError):
                continue
            silent.append(rank)
        return silent

    def diagnose(self, exc: BaseException) -> WorkerLost:
        """The WorkerLost behind a failed send or collective: a dead rank if there is one."""
        if self.lost is not None:
            return self.lost
        silent = self.unresponsive()  # also lets a rank that is exiting finish doing so
        dead = [r for r in self.dead_ranks() if r not in silent]
        if dead and not (_timed_out(exc) and silent):  # a peer closed its connections: it died
            return self.fail(dead[0], f"exited (code {self.procs[dead[0] - 1].exitcode})")
        first = str(exc).splitlines()[0][:160] if str(exc) else ""
        return self.fail(silent[0] if silent else None,
                         f"did not answer within the collective timeout ({exc.__class__.__name__}: {first})")

    def send(self, op: str, payload) -> None:
        if self.lost is not None:
            raise self.lost
        data = pickle.dumps((op, to_device(payload, "cpu")))
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(data)
            except (OSError, EOFError) as e:
                raise self.diagnose(e) from e


class MirroredStore:
    """A KV cache store whose every call the workers repeat on their own stores."""

    def __init__(self, store, channel: Channel):
        self.store, self.channel = store, channel

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    def _call(self, name: str, *args, kvs=None):
        self.channel.send("kv", (name, args))
        return getattr(self.store, name)(*args) if kvs is None else getattr(self.store, name)(*args, kvs)

    def write(self, rows: torch.Tensor, kvs) -> None:
        self._call("write", rows, kvs=kvs)

    def read(self, rows: torch.Tensor, L: int, key_mask: Optional[torch.Tensor], fresh: torch.Tensor) -> KVCache:
        return self._call("read", rows, L, key_mask, fresh)



class MirroredModel(nn.Module):
    """Rank 0's shard, called like a `MaskPredictor`; every call runs on all ranks."""

    def __init__(self, shard: MaskPredictor, channel: Channel, close):
        super().__init__()
        self.shard, self.channel, self._close = shard, channel, close
        self.cfg, self.shard_cfg = shard.cfg, shard.shard_cfg

    @property
    def dtype(self) -> torch.dtype:
        return self.shard.dtype

    @property
    def size(self) -> int:
        return len(self.channel.conns) + 1

    def kv_store(self, cls, rows: int, max_len: int, **kw) -> MirroredStore:
        self.channel.send("kv_store", (cls.__name__, rows, max_len, kw))
        return MirroredStore(self.shard.kv_store(cls, rows, max_len, **kw), self.channel)

    def forward(self, ids: torch.Tensor, key_mask=None, positions=None, out_index=None,
                cache: Optional[KVCache] = None, return_kv: bool = False, spans=None, head: bool = True,
                head_rows: Optional[int] = None):
        kw = dict(key_mask=key_mask, positions=positions, out_index=out_index, return_kv=return_kv,
                  spans=spans, head=head, head_rows=head_rows)
        # A cache's keys/values are each rank's own (read just before, or its block store);
        # only its indices travel.
        if cache is None:
            remote = None
        elif isinstance(cache, BlockCache):
            remote = ("block", cache.slots, cache.cols, cache.length, cache.rows)
        elif isinstance(cache, CanvasCache):
            remote = ("canvas", cache.slots, cache.fresh, cache.L, cache.key_mask, cache.rows)
        else:
            remote = (cache.key_mask, cache.fresh)
        self.channel.send("forward", (ids, kw, remote))
        try:
            return self.shard(ids, cache=cache, **kw)
        except RuntimeError as e:  # a collective failed: a peer died, or timed out
            raise self.channel.diagnose(e) from e

    def close(self) -> None:
        self._close()
