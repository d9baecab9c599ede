"""celeris.engine.threads: torch's default threads follow the CPUs this process may use (affinity and
cgroup quota), read from fake /proc/self/cgroup and cgroup trees."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from celeris.engine import threads


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def many_cpus(monkeypatch):
    monkeypatch.setattr(threads, "affinity_cpus", lambda: 64)


def test_cgroup_v2_quota_rounds_up(tmp_path, many_cpus):
    _write(tmp_path / "proc", "0::/kubepods/pod1/ctr\n")
    _write(tmp_path / "cg/kubepods/pod1/ctr/cpu.max", "150000 100000\n")
    assert threads.cgroup_cpu_quota(tmp_path / "proc", tmp_path / "cg") == 1.5
    assert threads.available_cpus(tmp_path / "proc", tmp_path / "cg") == 2


def test_cgroup_v2_parent_limit_binds(tmp_path, many_cpus):
    _write(tmp_path / "proc", "0::/a/b\n")
    _write(tmp_path / "cg/a/b/cpu.max", "max 100000\n")
    _write(tmp_path / "cg/a/cpu.max", "300000 100000\n")
    assert threads.available_cpus(tmp_path / "proc", tmp_path / "cg") == 3


def test_cgroup_v2_namespaced_root(tmp_path, many_cpus):
    """Inside a container's cgroup namespace the path is "/" and cpu.max sits at the mount root."""
    _write(tmp_path / "proc", "0::/\n")
    _write(tmp_path / "cg/cpu.max", "200000 100000\n")
    assert threads.available_cpus(tmp_path / "proc", tmp_path / "cg") == 2


def test_cgroup_v2_unlimited_uses_affinity(tmp_path, many_cpus):
    _write(tmp_path / "proc", "0::/\n")
    _write(tmp_path / "cg/cpu.max", "max 100000\n")
    assert threads.cgroup_cpu_quota(tmp_path / "proc", tmp_path / "cg") is None
    assert threads.available_cpus(tmp_path / "proc", tmp_path / "cg") == 64


def test_cgroup_v1_cfs_quota(tmp_path, many_cpus):
    _write(tmp_path / "proc", "4:memory:/docker/x\n2:cpu,cpuacct:/docker/x\n")
    _write(tmp_path / "cg/cpu,cpuacct/docker/x/cpu.cfs_quota_us", "400000\n")
    _write(tmp_path / "cg/cpu,cpuacct/docker/x/cpu.cfs_period_us", "100000\n")
    assert threads.available_cpus(tmp_path / "proc", tmp_path / "cg") == 4


def test_cgroup_v1_unlimited_quota(tmp_path, many_cpus):
    _write(tmp_path / "proc", "1:cpu:/\n")
    _write(tmp_path / "cg/cpu/cpu.cfs_quota_us", "-1\n")
    _write(tmp_path / "cg/cpu/cpu.cfs_period_us", "100000\n")
    assert threads.available_cpus(tmp_path / "proc", tmp_path / "cg") == 64


def test_small_quota_is_at_least_one_and_affinity_caps(tmp_path, monkeypatch):
    _write(tmp_path / "proc", "0::/\n")
    _write(tmp_path / "cg/cpu.max", "10000 100000\n")  # a tenth of a CPU
    monkeypatch.setattr(threads, "affinity_cpus", lambda: 8)
    assert threads.available_cpus(tmp_path / "proc", tmp_path / "cg") == 1
    _write(tmp_path / "cg/cpu.max", "1600000 100000\n")  # 16 CPUs of quota, but only 8 allowed
    assert threads.available_cpus(tmp_path / "proc", tmp_path / "cg") == 8


def test_missing_or_garbled_files_fall_back_to_affinity(tmp_path, many_cpus):
    assert threads.available_cpus(tmp_path / "no-such-file", tmp_path / "cg") == 64
    _write(tmp_path / "proc", "0::/\n")
    _write(tmp_path / "cg/cpu.max", "garbage\n")
    assert threads.available_cpus(tmp_path / "proc", tmp_path / "cg") == 64


def test_affinity_mask_is_read(monkeypatch):
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 3, 5})
    assert threads.affinity_cpus() == 3


def test_configure_threads_explicit_wins(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "available_cpus", lambda: 1)
    try:
        assert threads.configure_threads(None) == 1 and torch.get_num_threads() == 1
        assert threads.configure_threads(2) == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_serving_leaves_the_event_loop_a_core_from_four_cpus(monkeypatch):
    assert [threads.serving_threads(n) for n in (1, 2, 3, 4, 8, 64)] == [1, 2, 3, 3, 7, 63]
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "available_cpus", lambda: 8)
    try:
        assert threads.configure_threads(None, serving=True) == 7
        assert threads.configure_threads(None) == 8  # run / eval: no event loop to leave room for
        assert threads.configure_threads(2, serving=True) == 2  # --threads wins
    finally:
        torch.set_num_threads(before)


def test_a_tensor_thread_runs_its_jobs_in_order_on_one_thread():
    import threading

    tt = threads.TensorThread(name="test-tensor")
    seen = []
    futures = [tt.submit(lambda i=i: seen.append((i, threading.get_ident()))) for i in range(5)]
    for f in futures:
        f.result(timeout=10)
    assert [i for i, _ in seen] == list(range(5)) and {t for _, t in seen} == {tt.ident}
    assert tt.ident != threading.get_ident()
    with pytest.raises(ZeroDivisionError):
        tt.call(lambda: 1 / 0)
    assert tt.call(lambda x, y=0: x + y, 2, y=3) == 5  # an error does not end the thread
    tt.close()
    tt._thread.join(timeout=10)
    assert not tt._thread.is_alive()


def test_a_scheduler_given_the_loading_thread_steps_on_it(tiny_model_dir):
    """`celeris serve` loads the model on a TensorThread and hands it to the scheduler: every
    forward then runs on the thread that loaded the model (one OpenMP team, see engine/threads.py)."""
    import asyncio
    import threading

    from celeris.engine.config import EngineConfig
    from celeris.engine.llm import LLM
    from celeris.engine.sampling.params import SamplingParams
    from celeris.engine.loop.scheduler import Scheduler

    tt = threads.TensorThread(name="test-tensor")
    llm = tt.call(LLM.load, tiny_model_dir, EngineConfig(max_batch=2, max_queue=4, max_gen_length=64))
    stepped_on = set()
    step = llm.runner.step

    def recording_step(seqs):
        stepped_on.add(threading.get_ident())
        return step(seqs)

    llm.runner.step = recording_step

    async def go():
        sched = Scheduler(llm.loop, thread=tt)
        sched.start()
        with sched.submit(llm.request("Emma", SamplingParams(gen_length=16, steps=8, block_length=8, seed=0,
                                                                ignore_eos=True))) as s:
            events = [ev async for ev in s]
        await sched.stop()
        return events

    events = asyncio.run(asyncio.wait_for(go(), timeout=60))
    assert events[-1].finished and len(events) == 8
    assert stepped_on == {tt.ident}
    assert tt.call(lambda: 7) == 7  # the stopped scheduler's worker has given the thread back


def test_a_model_loaded_under_inference_mode_is_served_on_the_step_thread(tiny_model_dir):
    """Code that embeds the engine may load it under `torch.inference_mode()`; the step worker
    runs outside it, where an inference tensor cannot be written in place: the runner's state
    is built as normal tensors whatever the caller's mode."""
    import asyncio

    import torch

    from celeris.engine.config import EngineConfig
    from celeris.engine.llm import LLM
    from celeris.engine.sampling.params import SamplingParams
    from celeris.engine.loop.scheduler import Scheduler

    with torch.inference_mode():
        llm = LLM.load(tiny_model_dir, EngineConfig(max_batch=2, max_queue=4, max_gen_length=64))

    async def go():
        sched = Scheduler(llm.loop)
        sched.start()
        with sched.submit(llm.request("Emma", SamplingParams(gen_length=16, steps=8, block_length=8, seed=0))) as s:
            events = [ev async for ev in s]
        await sched.stop()
        return events

    events = asyncio.run(go())
    assert events[-1].finished and events[-1].finish_reason.value in ("length", "stop")


def _probe(env: dict[str, str]) -> list[str]:
    """`gemm_rows_invariant` at 1 and 2 threads, in a fresh process with `env`; also MKL_CBWR as
    celeris.engine left it."""
    import os
    import subprocess
    import sys

    code = ("import os, torch, celeris.engine.threads as t\n"
            "out = [os.environ.get('MKL_CBWR', '')]\n"
            "for n in (1, 2):\n"
            "    torch.set_num_threads(n)\n"
            "    out += [str(t.gemm_rows_invariant()), str(t.gemm_rows_invariant(width=1024, rows=96))]\n"
            "print(' '.join(out))\n")
    base = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    done = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          timeout=300, check=True)
    return done.stdout.split()


def test_importing_the_engine_makes_cpu_matmuls_round_rows_alike_at_every_padded_row_count():
    """What batch invariance rests on (engine/__init__.py). On an AVX-512 Intel host MKL's default
    rounds rows below ~16 and some 2-thread shapes by row count; the strict mode set at import
    does not (the probe: every multiple of the engine's ROW_ALIGN up to 64 and 96 rows). Checked in a fresh process, since MKL reads its mode once, at its first call."""
    assert _probe({}) == ["AUTO,STRICT"] + ["True"] * 4


def test_an_operators_mkl_mode_is_kept():
    assert _probe({"MKL_CBWR": "AUTO"})[0] == "AUTO"


def test_freeze_startup_heap_leaves_only_later_objects_to_the_collector():
    """In a fresh interpreter (it is process-wide): the start-up heap is frozen and counted, a
    full collection then sees only what was allocated after, and later garbage is still collected."""
    import subprocess
    import sys

    code = """
import gc, json
from celeris.engine.threads import freeze_startup_heap
heap = [{"k": [i]} for i in range(50_000)]  # tracked objects that live as long as the process
frozen = freeze_startup_heap()
ids = {id(o) for o in gc.get_objects()}
later = [{"k": [i]} for i in range(100)]
cycle = []
cycle.append(cycle)
del cycle
print(json.dumps({"frozen": frozen, "count": gc.get_freeze_count(), "heap_seen": id(heap[0]) in ids,
                  "tracked": len(gc.get_objects()), "later_seen": any(o is later[0] for o in gc.get_objects()),
                  "collected": gc.collect()}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    r = __import__("json").loads(out.stdout)
    assert r["frozen"] == r["count"] >= 100_000  # the heap's dicts and lists, the interpreter's own
    assert not r["heap_seen"] and r["tracked"] < 10_000  # a full collection walks only later objects
    assert r["later_seen"] and r["collected"] >= 1  # and collects later garbage as before
