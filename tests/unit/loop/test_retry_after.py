"""A refusal's retry delay: estimated from the queue and the step pace (engine/loop/retry_after.py),
jittered per refusal by the error table (server/errors.py), on both doors."""

from __future__ import annotations

import pytest
from google.rpc import error_details_pb2, status_pb2

from celeris.engine.errors import Overloaded
from celeris.engine.sampling.params import SamplingParams
from celeris.engine.loop.retry_after import CEILING_S, FLOOR_S, RetryEstimate, steps_until_start
from celeris.engine.loop.scheduler import Scheduler
from celeris.engine.loop.step_loop import StepRecord
from celeris.server.errors import RETRY_JITTER, to_openai, to_status
from tests.helpers import simulated_llm


def advertised(exc: Overloaded) -> float:
    """The RetryInfo delay a gRPC client would read."""
    status = status_pb2.Status.FromString(dict(to_status(exc).trailing_metadata)["grpc-status-details-bin"])
    info = error_details_pb2.RetryInfo()
    next(d for d in status.details if d.Is(info.DESCRIPTOR)).Unpack(info)
    return info.retry_delay.ToNanoseconds() / 1e9


def refuse(scheduler: Scheduler, llm, params: SamplingParams) -> Overloaded:
    """Submit requests until one is refused (the worker is not started: nothing runs); that refusal."""
    for k in range(100):
        try:
            scheduler.submit(llm.request(f"It is a truth {k}", params))
        except Overloaded as e:
            return e
    raise AssertionError("nothing refused")


def full_scheduler(tiny_model_dir, steps: int):
    """(scheduler, llm, the refusal of a full queue) over 2 slots and 4 waiting places."""
    llm = simulated_llm(tiny_model_dir, 0.0, max_batch=2)
    scheduler = Scheduler(llm.loop)
    return scheduler, llm, refuse(scheduler, llm, SamplingParams(gen_length=16, steps=steps, block_length=16, seed=0))


def test_steps_until_start_follows_the_slots_and_the_queue():
    assert steps_until_start([], [], slots=2, need=1) == 0  # a free slot
    assert steps_until_start([3, 5], [], slots=2, need=1) == 3  # the first to finish
    assert steps_until_start([3, 5], [4], slots=2, need=1) == 5  # the waiting one takes slot 1 (3 -> 7)
    assert steps_until_start([3, 5], [4, 4], slots=2, need=1) == 7
    assert steps_until_start([3, 5], [4, 4], slots=2, need=2) == 9  # a call of two samples


def test_the_estimate_tracks_the_queue_and_the_step_pace(tiny_model_dir):
    short, _, refusal_short = full_scheduler(tiny_model_dir, steps=4)
    long, llm, refusal_long = full_scheduler(tiny_model_dir, steps=16)
    # 2 slots, 4 waiting, none started: the caller would start after 3 rounds of the planned steps.
    assert refusal_short.retry_after_s == pytest.approx(max(FLOOR_S, 3 * 4 * short.retry_estimate.step_s))
    assert refusal_long.retry_after_s == pytest.approx(3 * 16 * long.retry_estimate.step_s)
    assert refusal_long.retry_after_s > refusal_short.retry_after_s  # longer queued work, longer wait
    pace = long.retry_estimate
    for k in range(10):  # steps of 0.2 s each, back to back: the pace follows
        pace.observe(StepRecord((), (), None, 100 + 0.2 * k, 100 + 0.2 * (k + 1)))
    assert pace.step_s == pytest.approx(0.2)
    assert pace.seconds(long.core) == pytest.approx(min(CEILING_S, 3 * 16 * 0.2))
    pace.observe(StepRecord((), (), None, 500.0, 500.0 + 60))  # a stalled step: capped
    assert pace.seconds(long.core) == CEILING_S
    assert refuse(long, llm, SamplingParams(gen_length=16, steps=16, block_length=16,
                                            seed=0)).retry_after_s == CEILING_S


def test_each_refusal_advertises_its_own_jittered_delay_never_sooner_than_estimated():
    exc = Overloaded("queue full", retry_after_s=2.0)
    grpc_delays = [advertised(exc) for _ in range(50)]
    assert all(2.0 <= d < 2.0 * (1 + RETRY_JITTER) for d in grpc_delays)
    assert len(set(grpc_delays)) > 40  # today every refusal said exactly the same
    http = [to_openai(exc)[2] for _ in range(50)]
    assert all(2000 <= int(h["retry-after-ms"]) <= 3000 and h["Retry-After"] in ("2", "3") for h in http)
    assert len({h["retry-after-ms"] for h in http}) > 40
    assert advertised(Overloaded("queue full", retry_after_s=10.0)) >= 10.0  # follows the estimate
