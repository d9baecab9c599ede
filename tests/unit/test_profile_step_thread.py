"""scripts/profile_step_thread.py reads py-spy's raw profile: which samples are the step
thread's, idle, in the model's forward, in the runner around it, or elsewhere."""

from __future__ import annotations

import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
ROOT = "Thread.run (threading.py:982);TensorThread._run (engine/threads.py:201);Scheduler._work (engine/scheduler.py:375)"


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
        f"{ROOT};StepLoop.step_later (engine/step_loop.py:134);BlockRunner.step (engine/block_runner.py:127);"
        "MaskPredictor.forward (/x/engine/model.py:193);Block.forward (/x/engine/model.py:103) 30",
        f"{ROOT};StepLoop.step_later (engine/step_loop.py:134);BlockRunner._select (engine/block_runner.py:214);"
        "select_tokens (engine/sampler.py:234) 9",
        f"{ROOT};publish (engine/scheduler.py:360);settle (engine/scheduler.py:350);Event.wait (threading.py:629) 4",
        "Thread.run (threading.py:982);_worker (concurrent/futures/thread.py:81) 50",  # another thread
        "garbage line",
    ])
    assert _split(raw) == {"idle": 7, "forward": 30, "runner": 9, "other": 4}
