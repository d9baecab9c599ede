"""How many CPU threads torch should use: the CPUs this process may actually run on.

torch's default is the host's core count, which inside a container or a cgroup with a CPU quota
(Kubernetes `resources.limits.cpu`) oversubscribes the quota and makes every step slower. The
limit is the smaller of the affinity mask (`taskset`, cpusets) and the CFS quota, read from
cgroup v2 (`cpu.max`) or v1 (`cpu.cfs_quota_us` / `cpu.cfs_period_us`) along this process's
cgroup path up to the root (a parent's limit binds the children too).

A server has a second consumer of CPU besides the forward: its asyncio event loop (gRPC
handlers, message building, protobuf serialization, HTTP/2 framing in gRPC's own threads). An
intra-op thread pool as wide as the CPUs runs every forward on all of them, so the loop preempts
one of the pool's threads, and a parallel region waits for its slowest thread: the whole step
stalls for the loop's slice. `serving_threads` therefore leaves one CPU to the loop when there
are at least `RESERVE_FROM` of them (one core is then at most a quarter of the forward's); on 2-3
CPUs a core is too large a share of the forward to give up, and all are used.
"""

from __future__ import annotations

import concurrent.futures
import gc
import math
import os
import queue
import sys
import threading
from pathlib import Path
from typing import Callable, Optional

PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (os.cpu_count() where the mask cannot be read)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _ancestors(root: Path, rel: str) -> list[Path]:
    """root/a/b, root/a, root: the cgroup and each parent inside the mount."""
    parts = [p for p in rel.strip("/").split("/") if p and p != ".."]
    return [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _v2_quota(root: Path, rel: str) -> Optional[float]:
    best: Optional[float] = None
    for d in _ancestors(root, rel):
        text = _read(d / "cpu.max")  # "max 100000" or "QUOTA PERIOD"
        if not text:
            continue
        fields = text.split()
        try:
            if fields[0] != "max" and int(fields[1]) > 0 and int(fields[0]) > 0:
                q = int(fields[0]) / int(fields[1])
                best = q if best is None else min(best, q)
        except (IndexError, ValueError):
            continue
    return best


def _v1_quota(root: Path, controllers: str, rel: str) -> Optional[float]:
    mounts = [root / controllers, root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"]
    mount = next((m for m in mounts if m.is_dir()), None)
    if mount is None:
        return None
    best: Optional[float] = None
    for d in _ancestors(mount, rel):
        quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
        try:
            if quota is not None and period is not None and int(quota) > 0 and int(period) > 0:
                q = int(quota) / int(period)
                best = q if best is None else min(best, q)
        except ValueError:
            continue
    return best


def cgroup_cpu_quota(proc_cgroup: Path = PROC_CGROUP, cgroup_root: Path = CGROUP_ROOT) -> Optional[float]:
    """The CFS CPU quota in CPUs (1.5 = 150 ms per 100 ms), or None when there is none."""
    text = _read(proc_cgroup)
    if text is None:
        return None
    found: list[float] = []
    for line in text.splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        if hier == "0" and controllers == "":  # cgroup v2, the unified hierarchy
            qs = [q for m in (cgroup_root, cgroup_root / "unified") if (q := _v2_quota(m, rel)) is not None]
            q = min(qs) if qs else None  # pure v2 mounts at the root, hybrid set-ups under unified/
        elif "cpu" in controllers.split(","):
            q = _v1_quota(cgroup_root, controllers, rel)
        else:
            continue
        if q is not None:
            found.append(q)
    return min(found) if found else None


def available_cpus(proc_cgroup: Path = PROC_CGROUP, cgroup_root: Path = CGROUP_ROOT) -> int:
    """CPUs this process may use: min(affinity, ceil(cgroup quota)), at least 1."""
    n = affinity_cpus()
    quota = cgroup_cpu_quota(proc_cgroup, cgroup_root)
    if quota is not None:
        n = min(n, max(1, math.ceil(quota - 1e-9)))
    return max(1, n)


RESERVE_FROM = 4  # CPUs from which a server leaves one to its event loop


def serving_threads(cpus: int) -> int:
    """Intra-op threads for a server on `cpus` CPUs: one fewer from RESERVE_FROM on (see above)."""
    return cpus - 1 if cpus >= RESERVE_FROM else max(1, cpus)


def configure_threads(threads: Optional[int] = None, serving: bool = False) -> int:
    """Set torch's intra-op threads: `threads` when given (--threads), else the CPUs this
    process may use (`serving`: less the event loop's core, see `serving_threads`). Returns the
    number set."""
    import torch

    n = threads if threads else (serving_threads(available_cpus()) if serving else available_cpus())
    torch.set_num_threads(n)
    return n


# How long a Python thread may hold the GIL while another waits for it (CPython's default is
# 5 ms). A server's step worker wakes from each step's device wait (a sleep, a CUDA sync) and
# then waits for the GIL while the event loop and the formatter thread build and send messages:
# at 5 ms, as long as a fast GPU step. 0.5 ms bounds that wait to a tenth of a 5 ms step.
SERVING_SWITCH_INTERVAL_S = 0.0005


def configure_switch_interval(seconds: float = SERVING_SWITCH_INTERVAL_S) -> None:
    """Set the interpreter's GIL switch interval (process-wide: serving processes only)."""
    sys.setswitchinterval(seconds)


def freeze_startup_heap() -> int:
    """Take everything alive now out of the cyclic garbage collector's reach (`gc.freeze`, after
    one last collection); returns how many objects that is. Process-wide: for a serving process
    (`celeris serve` once it has started, a tensor-parallel worker rank once its shard is loaded),
    whose start-up heap (the model's modules, the tokenizer, the grammars' tables, gRPC and
    torch's own objects) lives as long as the process. A full (oldest-generation) collection
    otherwise walks all of it with the GIL held, stalling every stream at once: ~70 ms with
    celeris-tiny on 2 CPUs (14 steps of a simulated 5 ms device), once every ~160 streamed
    256-step requests there. Afterwards it walks only what requests allocated since. Objects
    frozen are never collected, so a process that loads and drops models (the tests) must not
    call it."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def gemm_rows_invariant(width: int = 256, rows: int = 64, align: int = 4) -> bool:
    """Whether this process's float32 CPU matmul rounds each row the same at every row count that
    is a multiple of `align` (the engine's ROW_ALIGN padding), as batch invariance needs: a
    request's tokens alike alone and in any batch, a prompt's keys alike in any chunk. True under
    MKL's strict reproducibility mode, which celeris.engine asks for at import (its docstring);
    False when the environment chose another MKL_CBWR mode, or MKL ran before that import. A
    few small GEMMs (well under a millisecond), at the process's current thread count."""
    import torch

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(3 * width, width, generator=g), torch.randn(rows, width, generator=g)  # (3D, D), (R, D)
    whole = x @ w.T  # (R, 3D)
    return all(torch.equal(x[:n] @ w.T, whole[:n]) for n in range(align, rows, align))


def in_daemon_thread(fn: Callable[[], None], name: str) -> concurrent.futures.Future:
    """Run fn() in a new daemon thread (one never joined must not hold the interpreter at exit);
    its future carries fn's end, exception included."""
    done: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            done.set_exception(exc)
        else:
            done.set_result(None)

    threading.Thread(target=run, name=name, daemon=True).start()
    return done


class TensorThread:
    """One long-lived thread that runs, in order, every job handed to it: a server's tensor work
    (loading the model, then the scheduler's step loop) all on the same thread.

    Why: torch's CPU kernels run their parallel regions on an OpenMP team, and libgomp gives every
    thread that opens a region its own team. A model loaded on the main thread and stepped on a
    worker leaves two teams, more OpenMP threads than CPUs, and the worker's regions then run as
    with OMP_WAIT_POLICY=passive (no spinning between regions: each of a step's thousands of
    small regions waits for a wake-up). Measured on 2 CPUs (celeris-tiny, batch 16, gen 64,
    threshold 0.9, dual cache): a step took 16 ms on the thread that loaded the model, 29-31 ms
    on a second thread (as on the first under OMP_WAIT_POLICY=passive), and 16 ms again when
    the second thread had done the loading (`tests/unit/loop/test_threads.py` checks which thread
    runs the jobs, not the speed).

    A daemon thread, like the scheduler's own: a job that never ends cannot hold the
    interpreter at exit.
    """

    def __init__(self, name: str = "celeris-step"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def ident(self) -> Optional[int]:
        return self._thread.ident

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # the caller sees it on the future
                future.set_exception(exc)

    def submit(self, fn, *args, **kwargs):
        """Queue `fn(*args, **kwargs)` behind the jobs already queued -> concurrent.futures.Future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def call(self, fn, *args, **kwargs):
        """Run `fn` on the thread and wait for its result (or exception)."""
        return self.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        """End the thread once the queued jobs have run."""
        self._jobs.put(None)


__all__ = ["in_daemon_thread", "available_cpus", "cgroup_cpu_quota", "affinity_cpus", "configure_threads", "serving_threads",
           "TensorThread", "gemm_rows_invariant"]
