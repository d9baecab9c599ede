"""scripts/profile_step_thread.py reads py-spy's raw profile: which samples are the step
thread's, idle, in the model's forward, in the runner around it, or elsewhere."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"
ROOT = "Thread.run (threading.py:982);TensorThread._run (engine/threads.py:201);StepWorker.work (engine/loop/step_worker.py:128)"


def _split(raw: str):
    sys.path.insert(0, str(SCRIPTS))
    try:
        import profile_step_thread
    finally:
        sys.path.remove(str(SCRIPTS))
    return profile_step_thread.split(raw)


def test_samples_are_split_by_where_the_step_thread_is():
    raw = "\n".join([
        f"{ROOT};Event.wait (threading.py:629);Condition.wait (threading.py:327) 7",  # waiting for work
        f"{ROOT};StepLoop.step_later (engine/loop/step_loop.py:134);BlockRunner.step (engine/families/block/runner.py:127);"
        "MaskPredictor.forward (/x/engine/models/transformer.py:193);Block.forward (/x/engine/models/transformer.py:103) 30",
        f"{ROOT};StepLoop.step_later (engine/loop/step_loop.py:134);BlockRunner._select (engine/families/block/runner.py:214);"
        "select_tokens (engine/sampling/select.py:234) 9",
        f"{ROOT};publish (engine/loop/step_worker.py:111);settle (engine/loop/step_worker.py:101);Event.wait (threading.py:629) 4",
        "Thread.run (threading.py:982);_worker (concurrent/futures/thread.py:81) 50",  # another thread
        "garbage line",
    ])
    assert _split(raw) == {"idle": 7, "forward": 30, "runner": 9, "other": 4}


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_a_stopped_profile_stops_its_server():
    """SIGTERM while py-spy samples: the script exits and its `celeris serve` child is gone."""
    import os
    import re
    import shutil
    import signal
    import subprocess
    import time

    import pytest

    if shutil.which("py-spy") is None:
        pytest.skip("py-spy is not installed (the dev extra installs it)")
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / "profile_step_thread.py"), "--model", "celeris-tiny",
                             "--seconds", "120", "--threads", "1", "--concurrency", "1", "--gen-length", "32"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        while not (m := re.search(r"sampling the server \(pid (\d+)\)", "".join(lines))):
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        server = int(m[1])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while _alive(server) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(server), f"celeris serve (pid {server}) outlived its profile"
    finally:
        if proc.poll() is None:
            proc.kill()


def _alive(pid: int) -> bool:
    """Running, not a zombie (a reaped child's pid is gone; an unreaped one is 'Z')."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
