"""celeris.engine.loop.sim_runner: the GPU-paced fake runner drives the real step loop to the same ends as
the model would (blocks on schedule, ordinary tokens, no early stop) and paces each step."""

from __future__ import annotations

import dataclasses
import time

import pytest

from celeris.engine.families.registry import family_of
from celeris.engine.sampling.params import SamplingParams
from celeris.engine.loop.sim_runner import SimulatedRunner, ordinary_tokens, simulate
from celeris.engine.events import FinishReason
from tests.helpers import simulated_llm


@pytest.fixture
def sim_llm(tiny_model_dir):
    return simulated_llm(tiny_model_dir, 0.002)


def test_requests_finish_on_schedule_with_ordinary_tokens(sim_llm):
    params = SamplingParams(gen_length=32, steps=16, block_length=8, seed=0)
    events = []
    results = sim_llm.generate(["It is a truth", "Emma", "Mr. Darcy"], params, on_event=events.append)
    pool = set(ordinary_tokens(sim_llm.tokenizer))
    for r in results:
        assert r.steps == 16 and r.finish_reason == FinishReason.LENGTH
        assert len(r.token_ids) == 32 and set(r.token_ids) <= pool
    assert results[0].token_ids == results[1].token_ids  # ids follow positions, not the batch
    per_step = [len(e.committed) for e in events if e.request_id == events[0].request_id]
    assert per_step == [2] * 16  # 8-token blocks over 4 steps each
    assert sum(e.block_complete for e in events if e.request_id == events[0].request_id) == 4


def test_threshold_requests_also_finish(sim_llm):
    params = SamplingParams(gen_length=16, steps=16, block_length=8, threshold=0.9, seed=0)
    (r,) = sim_llm.generate(["Anne"], params)
    assert len(r.token_ids) == 16 and r.steps == 16  # one token a step: steps / blocks per block


def test_step_sleeps_the_step_time(sim_llm):
    runner = SimulatedRunner(2, 0.02, [5])
    seq = sim_llm.request("Anne", SamplingParams(gen_length=8, steps=8, block_length=8, seed=0))
    t0 = time.perf_counter()
    results, stats = runner.step([seq])
    assert time.perf_counter() - t0 >= 0.02 and stats.seconds >= 0.02
    assert results[0].positions == [0] and results[0].tokens == [5] and stats.committed == 1


def test_block_models_are_refused(tiny_llm):
    fake = dataclasses.replace(tiny_llm.model_config, arch="sdar", block_length=4)
    assert family_of(fake).block

    class Stub:
        family = family_of(fake)

    with pytest.raises(ValueError):
        simulate(Stub(), 0.01)
