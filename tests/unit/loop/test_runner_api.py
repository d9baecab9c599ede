"""engine/loop/runner_api.py: every runner is a `StepRunner`, whose optional members have their
defaults in the base class, so the step loop reads them and never probes (`getattr`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pytest

from celeris.engine.families.registry import ROWS
from celeris.engine.loop.runner_api import RowResult, StepRunner, StepStats
from celeris.engine.loop.sequence import Sequence
from celeris.engine.loop.sim_runner import SimulatedRunner, ordinary_tokens
from celeris.engine.loop.step_loop import StepLoop
from celeris.engine.sampling.params import SamplingParams
from tests.helpers import simulated_llm

STEP_LOOP = Path(__file__).resolve().parents[3] / "engine" / "loop" / "step_loop.py"


class Bare(StepRunner):
    """A runner with the required members only; its rows are the simulated runner's."""

    forward_overhead_tokens = 1

    def __init__(self, pool: list[int]):
        self.sim = SimulatedRunner(2, 0.0, pool)
        self.slots = self.sim.slots
        self.loaded: list[int] = []

    def row_tokens(self, seq: Sequence) -> int:
        return seq.length

    def forward_kind(self, seq: Sequence) -> None:
        return None

    def load(self, seq: Sequence) -> None:
        self.loaded.append(seq.slot)

    def step(self, seqs, during=None) -> tuple[list[RowResult], StepStats]:
        assert during is None, "a runner that does not overlap host work is never handed `during`"
        return self.sim.step(seqs)


@pytest.fixture(scope="module")
def sim_llm(tiny_model_dir):
    return simulated_llm(tiny_model_dir, 0.0)


def test_every_runner_is_a_step_runner():
    assert all(issubclass(row.runner, StepRunner) for row in ROWS)
    assert issubclass(SimulatedRunner, StepRunner)


def test_a_runner_can_not_leave_out_a_required_method():
    class NoStep(StepRunner):
        slots, forward_overhead_tokens = 1, 1
        row_tokens = forward_kind = load = staticmethod(lambda seq: 0)

    with pytest.raises(TypeError, match="step"):
        NoStep()


def test_the_optional_members_default_in_the_base_class_and_the_loop_never_probes(sim_llm):
    runner = Bare(ordinary_tokens(sim_llm.tokenizer))
    budget: Optional[int] = runner.forward_token_budget
    assert (budget, runner.overlaps_host, runner.resumable, runner.release(0)) == (None, False, None, None)
    loop = StepLoop(runner, max_queue=4)
    params = SamplingParams(gen_length=8, steps=4, block_length=8, seed=0)
    seqs = [sim_llm.request("It is a truth", params, request_id=f"r{i}") for i in range(3)]
    for s in seqs:
        loop.add(s)
    loop.step_later(during=lambda: None)  # runs `during` itself: this runner does not overlap
    loop.run_to_completion()
    assert all(s.finished and len(s.generated()) == 8 for s in seqs)
    assert loop.preemptions == 0 and runner.loaded == [0, 1, 0]  # the third waits for a slot
    assert "getattr" not in STEP_LOOP.read_text()
