"""A worker rank: load this rank's shard, then repeat the leader's calls until told to stop.

The leader sends each model call and KV cache store call over a pipe (engine/parallel/mirror.py);
the worker makes the same call on its shard, which meets the leader's collectives. It keeps
the last forward's keys/values (for the store write that follows) and the last cache read (for
the cached forward that follows). A closed pipe means the leader is gone: the worker exits.
"""

from __future__ import annotations

import os
import pickle
import sys

import torch

from celeris.engine.models.cache import BlockCache, BlockKVStore, CanvasCache, KVCacheStore
from celeris.engine.models.transformer import KVCache
from celeris.engine.parallel.group import Plan, init_group, worker_store
from celeris.engine.parallel.mirror import to_device
from celeris.engine.models.weights import Checkpoint
from celeris.engine.parallel.shard import load_shard
from celeris.engine.threads import freeze_startup_heap

STORES = {cls.__name__: cls for cls in (KVCacheStore, BlockKVStore)}


def follow(conn, model, device) -> None:
    """Repeat the leader's calls until 'stop' or the pipe closes."""
    store, pending, last_kvs = None, None, None
    while True:
        try:
            op, payload = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the leader is gone
        if op == "stop":
            return
        payload = to_device(payload, device)
        if op == "forward":
            ids, kw, cached = payload
            if cached is None:
                cache = None
            elif cached[0] == "block":  # this rank's own store, written in place
                cache = BlockCache(store, *cached[1:])
            elif cached[0] == "canvas":
                cache = CanvasCache(store, *cached[1:])
            else:
                cache = KVCache(pending[0], pending[1], cached[0], cached[1])
            out = model(ids, cache=cache, **kw)
            if kw["return_kv"]:
                last_kvs = out[1]
        elif op == "kv_store":
            name, rows, max_len, kw = payload
            store = model.kv_store(STORES[name], rows, max_len, **kw)
        elif op == "kv":
            name, args = payload
            if name == "write":
                getattr(store, name)(*args, last_kvs)
            else:  # read
                c = store.read(*args)
                pending = (c.keys, c.values)
        elif op == "ping":
            conn.send_bytes(pickle.dumps("pong"))


def main(rank: int, size: int, port: int, ckpt: Checkpoint, plan: Plan, dtype: str, device: str, backend: str,
         timeout_s: float, start_timeout_s: float, conn, load=load_shard, repeat=follow) -> None:
    """A worker process's entry point (spawned by engine/parallel/launch.py). `load` and `repeat`:
    its family's shard and loop (launch.Ranks; the mask families' by default)."""
    if device == "cpu":
        torch.set_num_threads(int(os.environ.get("CELERIS_WORKER_THREADS", "1")))
    else:
        torch.cuda.set_device(device)
    try:
        store = worker_store(port, size, start_timeout_s)
        store.set(f"joining/{rank}", "1")  # the leader waits for every rank's key, watching it live
        group = init_group(rank, size, store, backend, timeout_s)
        model = load(ckpt, plan, group, dtype, device)
        freeze_startup_heap()  # a full collection here would stall every collective of the group
        conn.send_bytes(pickle.dumps("ready"))
        with torch.inference_mode():
            repeat(conn, model, device)
    except Exception as e:  # one line for the leader's log; the leader reports the rank
        # one write, newline included: the leader's log lines share this stream
        sys.stderr.write(f"celeris tensor-parallel worker rank {rank}: {e.__class__.__name__}: {e}\n")
        sys.stderr.flush()
        os._exit(1)
    # Leave without tearing the group down: the leader has gone on, and gloo's threads would
    # abort a normal interpreter exit.
    sys.stderr.flush()
    os._exit(0)
