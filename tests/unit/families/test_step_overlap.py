"""StepLoop.step_later: a step's events are built later (the server builds them while the next
step runs on the device), and they are the events `step` returns; `during` runs exactly once a
step, before any sequence changes, inside the runner's step when it overlaps host work."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from celeris.engine.sampling.params import SamplingParams
from celeris.engine.loop.scheduler import Scheduler
from tests.helpers import simulated_llm

PARAMS = SamplingParams(gen_length=32, steps=16, block_length=8, seed=0, threshold=0.9)
PROMPTS = ["It is a truth", "Emma", "Mr. Darcy", "Anne"]


@pytest.fixture
def twins(tiny_model_dir):
    return simulated_llm(tiny_model_dir, 0.0), simulated_llm(tiny_model_dir, 0.0)


def _fill(llm):
    seqs = [llm.request(p, PARAMS) for p in PROMPTS]
    for s in seqs:
        llm.loop.add(s)
    return seqs


def test_built_later_the_events_are_those_of_step(twins):
    now, later = twins
    _fill(now)
    seqs = _fill(later)
    pending: list = []
    got, expected, unchanged, handed = [], [], [], []
    step = later.runner.step

    def spy(rows, during=None):  # the runner overlaps host work: it is handed `during`
        handed.append(during is not None)
        return step(rows, during=during)

    later.runner.step = spy
    while not now.loop.idle:
        expected += now.loop.step()[0]
        nfe = [s.nfe for s in seqs]

        def during(nfe=nfe):  # build the previous step's events, as the server does
            unchanged.append([s.nfe for s in seqs] == nfe)
            got.extend(b() for b in pending)

        pending, _ = later.loop.step_later(during=during)
    got += [b() for b in pending]
    anonymous = lambda evs: [dataclasses.replace(e, request_id="", ticket=0) for e in evs]  # noqa: E731
    assert anonymous(got) == anonymous(expected) and len(expected) == len(PROMPTS) * PARAMS.steps
    assert handed == [True] * PARAMS.steps
    assert unchanged == [True] * PARAMS.steps  # once a step, before any sequence changed


def test_a_runner_that_does_not_overlap_gets_during_before_its_step(twins):
    _, llm = twins
    _fill(llm)
    order = []
    step = llm.runner.step
    llm.runner.overlaps_host = False
    llm.runner.step = lambda seqs: (order.append("step"), step(seqs))[1]
    llm.loop.step_later(during=lambda: order.append("during"))
    assert order == ["during", "step"]
    assert llm.loop.step_later(during=None)[1] is not None and order[-1] == "step"


def test_served_streams_get_every_step_and_the_end_with_cancellations_between(twins):
    _, llm = twins

    async def main():
        sched = Scheduler(llm.loop)
        sched.start()
        streams = [sched.submit(llm.request(p, PARAMS)) for p in PROMPTS]
        got = {s.request_id: [] for s in streams}

        async def read(stream, cancel_after=None):
            async for ev in stream:
                got[stream.request_id].append(ev)
                if cancel_after is not None and len(got[stream.request_id]) == cancel_after:
                    sched.cancel(stream.request_id)

        await asyncio.gather(*(read(s, 3 if i == 0 else None) for i, s in enumerate(streams)))
        await sched.stop()
        return streams, got

    streams, got = asyncio.run(main())
    for s in streams[1:]:
        evs = got[s.request_id]
        assert [e.step for e in evs] == list(range(PARAMS.steps)) and evs[-1].finished
        assert not any(e.finish_reason and e.finish_reason.value == "cancelled" for e in evs)
    first = got[streams[0].request_id]
    assert 3 <= len(first) < PARAMS.steps and [e.step for e in first] == list(range(len(first)))


def _decode(llm, overlap: bool, prompts, params) -> tuple[list, list]:
    """Generated ids of each row, stepping with `step_later`; the runner told it overlaps host
    work (as on an accelerator) or not. Also what `during` saw: the runner's calls in flight."""
    runner_cls = type(llm.runner)
    seqs = [llm.sequence(p, dataclasses.replace(params, seed=i)) for i, p in enumerate(prompts)]
    for s in seqs:
        llm.loop.add(s)
    calls, handed = [], []
    original, step = runner_cls.overlaps_host, llm.runner.step

    def spy(rows, during=None):
        handed.append(during is not None)
        return step(rows, during=during)

    runner_cls.overlaps_host = property(lambda self: overlap)
    llm.runner.step = spy
    try:
        while not llm.loop.idle:
            llm.loop.step_later(during=lambda: calls.append(tuple(s.nfe for s in seqs)))
    finally:
        runner_cls.overlaps_host = original
        del llm.runner.step
    assert handed == [overlap] * len(handed)
    return [(s.generated(), s.nfe) for s in seqs], calls


@pytest.mark.parametrize("arch", ["llada", "sdar"])
def test_real_runners_decode_the_same_when_their_reads_wait_for_during(arch, tiny_model_dir, tmp_path):
    """Runner and BlockRunner queue every group, run `during`, then read: the same tokens and
    counts as reading at once, and `during` once a step (on the CPU this is only the order)."""
    from celeris.engine.config import EngineConfig
    from celeris.engine.llm import LLM
    from tests.unit.block_references.checkpoints import write_sdar_checkpoint

    folder = tiny_model_dir if arch == "llada" else write_sdar_checkpoint(tmp_path, seed=0)
    # No prefix cache: the second decode would find the first one's prompt blocks and run fewer forwards.
    config = EngineConfig(max_batch=4, max_prompt_tokens=64, max_gen_length=64, prefill_chunk=8, prefix_cache_bytes=0)
    params = SamplingParams(gen_length=16, block_length=4, steps=8, threshold=0.5, stop_at_eos=False,
                            **({"kv_cache": "dual"} if arch == "llada" else {}))
    prompts = [[17, 201, 45], [88, 5, 140, 31, 77, 102, 15, 9], [12, 33, 99, 4]]
    llm = LLM.load(folder, config)
    eager, _ = _decode(llm, False, prompts, params)
    overlapped, calls = _decode(llm, True, prompts, params)
    assert overlapped == eager
    assert len(calls) == llm.loop.steps // 2 and len(set(calls)) == len(calls)  # once a step, each before its apply


def test_a_request_whose_load_fails_ends_with_the_error_and_frees_its_slot(twins):
    """Admission runs in the step worker: a runner.load that raises ends that request (its
    stream gets the step failure), frees its slot, and the next request is served."""
    from celeris.engine.errors import StepFailed

    _, llm = twins
    load = llm.runner.load
    broken = []

    def flaky_load(seq):
        if not broken:
            broken.append(seq.request_id)
            raise RuntimeError("device lost")
        return load(seq)

    llm.runner.load = flaky_load

    async def main():
        sched = Scheduler(llm.loop)
        sched.start()
        first = sched.submit(llm.request("Emma", PARAMS))
        with pytest.raises(StepFailed, match="RuntimeError") as failed:  # the type: the text may quote any request
            async for _ in first:
                pass
        assert "device lost" not in str(failed.value)
        events = [ev async for ev in sched.submit(llm.request("Anne", PARAMS))]
        await sched.stop()
        return events

    events = asyncio.run(asyncio.wait_for(main(), 30))
    assert events[-1].finished and len(events) == PARAMS.steps
    assert llm.loop.idle and sorted(llm.loop.free_slots) == list(range(llm.runner.slots))
