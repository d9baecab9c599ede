"""Start the worker ranks, load the leader's shard, and supervise the group.

`start` checks the sizes (before any process starts), spawns ranks 1..N-1 (torch.multiprocessing
spawn; each loads only its shard), joins the group as rank 0 and returns the leader's
model: `MirroredModel` for the mask families; another family passes its own `Ranks` (DiffusionGemma:
engine/families/revise/parallel.py). A watcher thread waits on the workers' process sentinels: a worker that exits
breaks the group at once (later calls raise `WorkerLost` naming the rank) and calls the
`on_lost` callbacks (the server goes NOT_SERVING and exits). A worker that hangs is caught by
the collectives' timeout. Closing stops the workers, and kills any that do not stop.
"""

from __future__ import annotations

import atexit
import logging
import pickle
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from celeris.engine.config import EngineConfig
from celeris.engine.models.weights import Checkpoint
from celeris.engine.parallel import worker
from celeris.engine.parallel.group import Plan, backend_for, check_sizes, init_group, leader_store
from celeris.engine.parallel.mirror import Channel, MirroredModel
from celeris.engine.parallel.shard import checkpoint_parameters, load_shard

log = logging.getLogger("celeris.parallel")
START_TIMEOUT_S = 600.0  # loading a large shard takes a while


@dataclass(frozen=True)
class Ranks:
    """What a model family's ranks run (module-level functions: the spawned workers get them by name).
    `check` (ckpt, plan) refuses sizes before any process starts; `load` (ckpt, plan, group, dtype,
    device) is one rank's shard; `follow` (conn, shard, device) is a worker's loop; `mirror` (shard,
    channel, close) is the leader's model; `parameters` (ckpt) counts the whole model's."""

    check: Callable[..., None]
    load: Callable[..., Any]
    follow: Callable[..., None]
    mirror: Callable[..., Any]
    parameters: Callable[[Any], int]


def _check_masked(ckpt: Checkpoint, plan: Plan) -> None:
    check_sizes(ckpt.cfg, plan)


def _masked_parameters(ckpt: Checkpoint) -> int:
    return checkpoint_parameters(ckpt.folder)


MASKED = Ranks(_check_masked, load_shard, worker.follow, MirroredModel, _masked_parameters)  # the mask families'


def device_of(device: str, rank: int) -> str:
    return "cpu" if device == "cpu" else f"cuda:{rank}"


class Supervisor:
    """Watches the worker processes; stops them when the leader closes."""

    def __init__(self, procs: list, conns: list, channel: Channel):
        self.procs, self.conns, self.channel = procs, conns, channel
        self.on_lost = channel.on_lost  # callbacks: the group is broken (a worker died or hung)
        self.closing = False
        atexit.register(self.close)  # a leader that never called close still stops its workers quietly
        threading.Thread(target=self._watch, name="celeris-tp-watch", daemon=True).start()

    def _watch(self) -> None:
        ready = wait([p.sentinel for p in self.procs])
        if self.closing:
            return
        rank = next(r for r, p in enumerate(self.procs, start=1) if p.sentinel in ready)
        self.procs[rank - 1].join(timeout=5)  # reap it, for its exit code
        had_callbacks = bool(self.on_lost)
        lost = self.channel.fail(rank, f"exited (code {self.procs[rank - 1].exitcode})")
        if not had_callbacks:  # else a callback reports it (one line)
            log.error("%s", lost)

    def close(self) -> None:
        if self.closing:
            return
        self.closing = True
        atexit.unregister(self.close)
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(("stop", None)))
            except OSError:
                pass
        for p in self.procs:
            p.join(timeout=1 if self.channel.lost else 10)  # a broken group's ranks may never stop
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if dist.is_initialized():  # so that this process may form another group later
            dist.destroy_process_group()


def _await_ready(procs: list, conns: list, timeout_s: float) -> None:
    for rank, (p, conn) in enumerate(zip(procs, conns), start=1):
        if not conn.poll(timeout_s):
            raise RuntimeError(f"tensor-parallel worker rank {rank} did not load within {timeout_s:.0f} s")
        try:
            conn.recv_bytes()
        except EOFError:
            raise RuntimeError(f"tensor-parallel worker rank {rank} failed to start (exit code {p.exitcode})") from None


def _join(n: int, backend: str, timeout_s: float, store, procs: list):
    """Join the group as rank 0 once every worker is about to: a worker that dies before it
    joins fails the start at once instead of leaving the rendezvous waiting for it."""
    waiting = set(range(1, n))
    while waiting:
        waiting = {r for r in waiting if not store.check([f"joining/{r}"])}
        dead = [(r, procs[r - 1].exitcode) for r in sorted(waiting) if not procs[r - 1].is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel worker rank {dead[0][0]} exited (code {dead[0][1]}) before "
                               "joining the group")
        time.sleep(0.05 if waiting else 0)
    return init_group(0, n, store, backend, timeout_s)


def start(ckpt: Any, config: EngineConfig, ranks: Ranks = MASKED) -> Any:
    """The leader's model over `config.tensor_parallel_size` ranks; workers spawned here."""
    plan = Plan(config.tensor_parallel_size, config.expert_parallel)
    ranks.check(ckpt, plan)
    n, backend = plan.size, backend_for(config.device)
    store = leader_store(n, START_TIMEOUT_S)
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for rank in range(1, n):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=worker.main, name=f"celeris-tp-rank{rank}", daemon=True,
                        args=(rank, n, store.port, ckpt, plan, config.dtype, device_of(config.device, rank),
                              backend, config.collective_timeout_s, START_TIMEOUT_S, child, ranks.load, ranks.follow))
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    channel = Channel(conns, procs)
    supervisor = Supervisor(procs, conns, channel)
    try:
        group = _join(n, backend, config.collective_timeout_s, store, procs)
        shard = ranks.load(ckpt, plan, group, config.dtype, device_of(config.device, 0))
        _await_ready(procs, conns, START_TIMEOUT_S)
    except BaseException:
        supervisor.close()
        raise
    model = ranks.mirror(shard, channel, supervisor.close)
    model.supervisor = supervisor
    model.total_parameters = ranks.parameters(ckpt)  # the leader holds about 1/N of them
    return model
