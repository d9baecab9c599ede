"""celeris.engine.loop.scheduler: step n's events are formatted in the formatter thread while step n+1 runs,
in step order, never more than one step behind, and nothing a step produced is lost."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from celeris.engine.sampling.params import SamplingParams
from celeris.engine.loop.scheduler import Scheduler
from tests.helpers import simulated_llm

STEP_S = 0.02


@pytest.fixture
def sim_llm(tiny_model_dir):
    return simulated_llm(tiny_model_dir, STEP_S)


class SlowFormatter:
    """Records where and when each event is formatted; takes most of a step to do it."""

    def __init__(self, log: list):
        self.log = log

    def __call__(self, ev):
        start = time.monotonic()
        time.sleep(0.7 * STEP_S)
        self.log.append((ev.request_id, ev.step, threading.current_thread().name, start, time.monotonic()))
        return f"{ev.request_id}:{ev.step}"


async def _serve(llm, prompts, params, stop_early: bool = False):
    steps: list = []
    sched = Scheduler(llm.loop, on_step=steps.append)
    sched.start()
    log: list = []
    streams = [sched.submit(llm.request(p, params, request_id=f"r{i}"), SlowFormatter(log))
               for i, p in enumerate(prompts)]

    async def read(stream):
        return [ev.formatted async for ev in stream]

    if stop_early:  # stop while steps are in flight: every event that reached a stream is formatted
        reads = [asyncio.ensure_future(read(s)) for s in streams]
        await asyncio.sleep(3 * STEP_S)
        await sched.stop()
        return await asyncio.gather(*reads), log, steps
    got = await asyncio.gather(*(read(s) for s in streams))
    await sched.stop()
    return got, log, steps


def test_events_are_formatted_beside_the_next_step_in_order(sim_llm):
    params = SamplingParams(gen_length=8, steps=8, block_length=8, seed=0)
    got, log, steps = asyncio.run(_serve(sim_llm, ["Emma", "Anne"], params))
    for i, messages in enumerate(got):  # every step's message, in step order
        assert messages == [f"r{i}:{k}" for k in range(8)]
    assert {name for *_, name, _, _ in log} == {"celeris-format_0"}
    # Formatting of step k overlaps step k+1's forward (the step worker never waited for it).
    step_spans = [(r.started, r.ended) for r in steps]
    wall = time.time() - time.monotonic()
    overlapped = sum(any(s < f_end + wall and f_start + wall < e for s, e in step_spans)
                     for _, _, _, f_start, f_end in log)
    assert overlapped >= len(log) // 2
    # Never more than one step behind: a step's events are formatted before the step after next ends.
    for rid, k, _, _, f_end in log:
        if k + 2 < len(steps):
            assert f_end + wall <= steps[k + 2].ended


def test_stop_loses_no_formatted_event(sim_llm):
    params = SamplingParams(gen_length=64, steps=64, block_length=8, seed=0)
    got, log, steps = asyncio.run(_serve(sim_llm, ["Emma"], params, stop_early=True))
    (messages,) = got
    assert messages and all(m is not None for m in messages)
    assert messages[:len(steps)] == [f"r0:{k}" for k in range(len(steps))]  # every step ran reached the stream


def test_a_request_submitted_on_the_last_event_is_served(sim_llm):
    """The last events of an idle engine are delivered while the loop goes to sleep; a reader
    that submits its next request on them must wake it (a lost wake-up hung `celeris bench`)."""
    params = SamplingParams(gen_length=8, steps=4, block_length=8, seed=0)

    async def go():
        sched = Scheduler(sim_llm.loop)
        sched.start()
        done = 0
        for i in range(5):  # one at a time: each submit lands as the engine turns idle
            with sched.submit(sim_llm.request("Emma", params, request_id=f"r{i}")) as stream:
                events = [ev async for ev in stream]
            done += events[-1].finished
        await sched.stop()
        return done

    assert asyncio.run(asyncio.wait_for(go(), timeout=30)) == 5


def test_the_worker_steps_without_the_event_loop_and_at_most_one_step_ahead(sim_llm):
    """The step worker starts each step itself: with the event loop blocked it runs the step in
    flight and the next one, then waits for the first's events to be delivered (one step deep)."""
    params = SamplingParams(gen_length=16, steps=16, block_length=8, seed=0)

    async def go():
        sched = Scheduler(sim_llm.loop)
        sched.start()
        stream = sched.submit(sim_llm.request("Emma", params, request_id="r0"))
        await asyncio.sleep(0)  # the wake-up runs at the end of this iteration
        time.sleep(12 * STEP_S)  # block the event loop: no hand-off through it can happen
        blocked_steps = sim_llm.loop.steps
        events = [ev async for ev in stream]
        stream.close()
        await sched.stop()
        return blocked_steps, events

    blocked_steps, events = asyncio.run(asyncio.wait_for(go(), timeout=30))
    assert blocked_steps == 2
    assert [ev.step for ev in events] == list(range(16)) and events[-1].finished


def test_with_formatted_is_replace_of_that_one_field():
    """The formatter thread's copy (StepEvent.with_formatted) equals dataclasses.replace, field by
    field, and leaves the event it copies as it was."""
    import dataclasses

    from celeris.engine.events import FinishReason, StepEvent

    ev = StepEvent(request_id="r", step=3, total_steps=8, block=1, num_blocks=2, canvas=(5, 6, 0), committed=(1,),
                   confidences=(0.5,), generated=(5, 6), visible=3, settled=2, steps=4, forward_passes=4, seed=7,
                   prompt_tokens=2, finished=True, finish_reason=FinishReason.LENGTH, provisional=((2, 9, 0.4),))
    out = ev.with_formatted("message")
    assert out == dataclasses.replace(ev, formatted="message") and out is not ev
    assert out.formatted == "message" and ev.formatted is None
    assert {f.name: getattr(out, f.name) for f in dataclasses.fields(ev) if f.name != "formatted"} == \
        {f.name: getattr(ev, f.name) for f in dataclasses.fields(ev) if f.name != "formatted"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.formatted = None
