"""Reliability: load, faults, crash and restart, drain, and fuzzed input, on loopback.

Every server here is a real `celeris serve` process (tests/integration/server_process.py), so
a crash fails the test (with the server's faulthandler trace in the message) instead of taking
pytest down, and memory is the server's own. Each test is bounded:
per-call deadlines, an overall asyncio timeout, and a fixed request count or duration.
Figures (requests completed, rejections, fuzz cases) are printed; run with -s to see them.
"""

from __future__ import annotations

import asyncio
import collections
import math
import random
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from celeris.v1 import generation_pb2 as pb
from celeris.v1 import generation_pb2_grpc as pb_grpc
from celeris.engine.training.data import EOS_ID, MASK_ID
from tests.integration.server_process import ServerProcess, assert_refused, field_violations, retry_delay_s

pytestmark = pytest.mark.slow

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
CLEAN_REJECTIONS = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}
PROMPT = "It is a truth universally acknowledged"


def request(gen_length: int, steps: int, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=PROMPT, gen_length=gen_length, steps=steps, block_length=gen_length, **kw)


def check_stream(msgs: list[pb.GenerateResponse], gen_length: int) -> None:
    """A well-formed Generate stream: snapshots, then exactly one final done message."""
    assert msgs and msgs[-1].done and not any(m.done for m in msgs[:-1])
    assert msgs[-1].finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
    assert [m.step for m in msgs] == sorted(m.step for m in msgs)
    assert all(len(m.tokens) == gen_length for m in msgs)


async def read_all(call) -> list[pb.GenerateResponse]:
    return [m async for m in call]


@pytest.fixture(scope="module")
def shared_server(tiny_model_dir, tmp_path_factory):
    """One server for the load and fuzz tests: batch 16, queue 24, small generation limits."""
    log = tmp_path_factory.mktemp("reliability") / "server.log"
    proc = ServerProcess(tiny_model_dir, log, "--max-batch", "16", "--max-queue", "24",
                         "--max-gen-length", "64", "--max-prompt-tokens", "64")
    try:
        yield proc.start()
    finally:
        proc.close()


# ---------------------------------------------------------------- load

LOAD_STREAMS, LOAD_SECONDS, LOAD_GEN = 64, 8.0, 32


async def test_load_64_concurrent_streams_complete_or_are_cleanly_rejected(shared_server):
    """64 clients loop for a fixed time over 4 connections. Capacity is 16 running + 24 queued,
    so some are refused: they must get RESOURCE_EXHAUSTED with RetryInfo (and retry after it),
    every other request must complete with a well-formed stream, and nothing may hang."""
    before = shared_server.metrics()
    outcomes: collections.Counter = collections.Counter()
    latencies: list[float] = []
    end = time.monotonic() + LOAD_SECONDS
    channels = [grpc.aio.insecure_channel(shared_server.target) for _ in range(4)]

    async def client(i: int) -> None:
        stub = pb_grpc.GenerationServiceStub(channels[i % len(channels)])
        while time.monotonic() < end:
            t0 = time.monotonic()
            try:
                msgs = await read_all(stub.Generate(request(LOAD_GEN, LOAD_GEN // 2, seed=i), timeout=30))
            except grpc.aio.AioRpcError as e:
                outcomes[e.code().name] += 1
                assert e.code() in CLEAN_REJECTIONS, f"client {i}: {e.code()} {e.details()}"
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    delay = retry_delay_s(e)
                    assert delay is not None and delay > 0, "RESOURCE_EXHAUSTED without RetryInfo"
                    await asyncio.sleep(min(delay, 1.0) * random.uniform(0.5, 1.0))
                continue
            check_stream(msgs, LOAD_GEN)
            outcomes["OK"] += 1
            latencies.append(time.monotonic() - t0)

    try:
        await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(LOAD_STREAMS))), LOAD_SECONDS + 45)
    finally:
        for ch in channels:
            await ch.close()

    latencies.sort()
    print(f"\nload: {LOAD_STREAMS} streams x {LOAD_SECONDS:.0f} s (gen_length={LOAD_GEN}, steps={LOAD_GEN // 2}): "
          f"{dict(outcomes)}; p50 {latencies[len(latencies) // 2]:.2f} s, max {latencies[-1]:.2f} s")
    # No per-client fairness is promised (a client that just finished resubmits at once while a
    # refused one waits out its RetryInfo), but the server must keep its batch busy throughout.
    assert outcomes["OK"] >= LOAD_STREAMS, "fewer completions than clients in the whole run"
    assert outcomes["RESOURCE_EXHAUSTED"] > 0, "64 streams against 40 places should overflow the queue"
    assert shared_server.alive and shared_server.health() == SERVING
    # the server counted exactly what the clients saw, and its queue and batch are empty again
    after = shared_server.metrics()
    for code in ("OK", "RESOURCE_EXHAUSTED"):
        key = f"celeris_requests_total{{code={code},outcome={'ok' if code == 'OK' else 'error'}}}"
        assert after.get(key, 0) - before.get(key, 0) == outcomes[code], key
    assert after["celeris_queue_depth"] == 0 and after["celeris_running_requests"] == 0


# ---------------------------------------------------------------- faults: cancels and deadlines

SOAK_REQUESTS, SOAK_CONCURRENCY = 400, 24


async def test_soak_with_client_cancels_and_short_deadlines_leaves_nothing_behind(spawn):
    """Several hundred requests, most cut short by a client cancel or a deadline at a random
    moment (before the first snapshot, mid-stream, or never). The server process must survive,
    keep its memory flat after warm-up, and end with nothing active, queued or running: every
    request id of the soak is free again (a leaked request would still hold its id: "already
    running"), and the queue-depth and running gauges read zero."""
    proc = spawn("--max-batch", "8", "--max-queue", "16", "--max-gen-length", "64", "--max-prompt-tokens", "64")
    rng = random.Random(1234)
    outcomes: collections.Counter = collections.Counter()
    rejected = 0
    expected = {  # OK: the request finished before the cancel or deadline landed
        "complete": {"OK"},
        "cancel": {"CANCELLED", "OK"},
        "deadline": {"DEADLINE_EXCEEDED", "OK"},
    }

    async def attempt(stub, rid: str, kind: str, after: int, timeout: float) -> str:
        call = stub.Generate(request(32, 16, request_id=rid, seed=rng.randrange(1000)),
                             timeout=timeout if kind == "deadline" else 20)
        try:
            if kind == "cancel" and after < 0:
                call.cancel()  # before the first snapshot
            else:
                n = 0
                async for _ in call:
                    n += 1
                    if kind == "cancel" and n > after:
                        call.cancel()
                        break
            return (await call.code()).name
        except grpc.aio.AioRpcError as e:
            return e.code().name

    async def one(stub, rid: str) -> None:
        """One request, retried (like a well-behaved client) while the server answers
        RESOURCE_EXHAUSTED: cancelled requests keep their place until the current step ends,
        so fast cancel churn can fill the queue for a moment."""
        nonlocal rejected
        kind = rng.choices(["complete", "cancel", "deadline"], [1, 2, 2])[0]
        after, timeout = rng.randrange(-1, 8), rng.uniform(0.005, 0.3)
        for _ in range(100):
            code = await attempt(stub, rid, kind, after, timeout)
            if code != "RESOURCE_EXHAUSTED":
                break
            rejected += 1
            await asyncio.sleep(rng.uniform(0.02, 0.1))
        assert proc.alive, f"server died ({proc.proc.returncode}):\n{proc.log_tail(40)}"
        assert code in expected[kind], f"{kind}: {code}"
        outcomes[f"{kind}:{code}"] += 1

    async def soak(stub, ids: range) -> None:
        sem = asyncio.Semaphore(SOAK_CONCURRENCY)

        async def limited(i: int) -> None:
            async with sem:
                await one(stub, f"soak-{i}")

        await asyncio.wait_for(asyncio.gather(*(limited(i) for i in ids)), 120)
        assert proc.alive, f"server died ({proc.proc.returncode}):\n{proc.log_tail()}"

    async with grpc.aio.insecure_channel(proc.target) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        warm = SOAK_REQUESTS // 4
        await soak(stub, range(warm))
        rss_warm = proc.rss_kib()
        await soak(stub, range(warm, SOAK_REQUESTS))
        growth_mib = (proc.rss_kib() - rss_warm) / 1024

        # every id is free again: resubmit each one (8 at a time: never over capacity)
        sem = asyncio.Semaphore(8)

        async def reuse(i: int) -> None:
            async with sem:
                check_stream(await read_all(stub.Generate(request(4, 2, request_id=f"soak-{i}"), timeout=20)), 4)

        await asyncio.wait_for(asyncio.gather(*(reuse(i) for i in range(SOAK_REQUESTS))), 60)

    m = proc.metrics()
    cut_short = sum(v for k, v in outcomes.items() if k.split(":")[1] in ("CANCELLED", "DEADLINE_EXCEEDED"))
    print(f"\nsoak: {SOAK_REQUESTS} requests, {cut_short} cut short by cancel/deadline: "
          f"{dict(sorted(outcomes.items()))}; {rejected} RESOURCE_EXHAUSTED retried; "
          f"server RSS growth after warm-up {growth_mib:+.1f} MiB")
    assert sum(outcomes.values()) == SOAK_REQUESTS
    assert cut_short >= SOAK_REQUESTS // 2, "the soak should mostly cut requests short"
    assert m["celeris_queue_depth"] == 0 and m["celeris_running_requests"] == 0
    assert not [k for k in m if k.startswith("celeris_requests_total") and ("INTERNAL" in k or "UNKNOWN" in k)], m
    assert growth_mib < 16, f"server RSS grew {growth_mib:.1f} MiB over {SOAK_REQUESTS - warm} requests"
    assert proc.alive and proc.health() == SERVING


# ---------------------------------------------------------------- crash, restart, drain

async def start_streams(target: str, n: int, gen_length: int):
    """n long streams on one channel; returns (channel, tasks) once every stream has a snapshot."""
    channel = grpc.aio.insecure_channel(target)
    stub = pb_grpc.GenerationServiceStub(channel)
    started = [asyncio.Event() for _ in range(n)]

    async def stream(i: int) -> tuple[list[pb.GenerateResponse], float]:
        msgs = []
        async for m in stub.Generate(request(gen_length, gen_length, seed=i), timeout=60):
            msgs.append(m)
            started[i].set()
        return msgs, time.monotonic()

    tasks = [asyncio.ensure_future(stream(i)) for i in range(n)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
    assert not any(t.done() for t in tasks), "streams finished too early to be interrupted"
    return channel, tasks


async def test_sigkill_mid_stream_gives_unavailable_and_a_restarted_server_serves_again(spawn):
    first = spawn("--max-gen-length", "256")
    channel, tasks = await start_streams(first.target, 6, 256)
    try:
        first.send_signal(signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 15)
        codes = [r.code() if isinstance(r, grpc.aio.AioRpcError) else r for r in results]
        assert codes == [grpc.StatusCode.UNAVAILABLE] * 6, codes
        stub = pb_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as e:  # while it is down: fail fast, not hang
            await read_all(stub.Generate(request(16, 8), timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE

        spawn("--max-gen-length", "256", port=first.port)  # same port, same client channel
        msgs = await read_all(stub.Generate(request(16, 8), timeout=30, wait_for_ready=True))
        check_stream(msgs, 16)
    finally:
        await channel.close()
    print("\nkill: 6 streams cut by SIGKILL -> UNAVAILABLE; restarted server on the same port served the same channel")


async def test_sigterm_lets_in_flight_streams_finish_then_refuses_and_exits(spawn):
    drain = 1.0
    proc = spawn("--max-gen-length", "128", "--drain-seconds", str(drain), "--grace-seconds", "30")
    channel, tasks = await start_streams(proc.target, 6, 128)
    try:
        t_term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait_for_event, "server.draining")
        # balancers see the drain at once: health is NOT_SERVING from server.draining on (phases
        # from its log, not the clock); no answer only once the door is already closing
        status = proc.health()
        assert status == NOT_SERVING or (status is None and proc.logged("server.refusing")), status
        await asyncio.to_thread(proc.wait_for_event, "server.refusing")
        stub = pb_grpc.GenerationServiceStub(channel)
        await assert_refused(lambda: read_all(stub.Generate(request(16, 8), timeout=10)))

        results = await asyncio.wait_for(asyncio.gather(*tasks), 45)
        for msgs, _ in results:
            check_stream(msgs, 128)  # completed, not FINISH_REASON_CANCELLED
        assert max(t for _, t in results) > t_term + drain, "no stream outlived the drain: grace untested"
        assert await asyncio.to_thread(proc.wait, 30) == 0
    finally:
        await channel.close()
    print(f"\ndrain: SIGTERM with 6 streams in flight; all 6 finished, last "
          f"{max(t for _, t in results) - t_term:.1f} s after SIGTERM; exit code 0")


async def test_an_engine_fault_fails_its_requests_then_the_server_recovers_or_stops_serving(spawn):
    """A step that raises (CUDA out of memory, a sampler bug) must end its requests with an error
    status at once, and then either the server goes on serving, or it stops reporting SERVING
    so that the liveness probe restarts it. Hanging while SERVING is the one wrong answer."""
    proc = spawn(module="tests.integration.fault_server", env={"CELERIS_FAULT_STEP": "2"})  # 1 = warm-up
    async with grpc.aio.insecure_channel(proc.target) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await read_all(stub.Generate(request(16, 8), timeout=5))
        assert e.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE), e.value
        try:
            check_stream(await read_all(stub.Generate(request(16, 8), timeout=5)), 16)
        except grpc.aio.AioRpcError:
            assert not proc.alive or proc.health() != SERVING, "not serving requests, yet health says SERVING"


# ---------------------------------------------------------------- fuzzed input

U32 = 2**32 - 1
UINT32S = st.one_of(st.integers(0, 70), st.sampled_from([0, 1, 63, 64, 65, 2**31 - 1, 2**31, U32]),
                    st.integers(-(2**31), -1).map(lambda v: v & U32))  # negative ints as the wire wraps them
FLOATS = st.one_of(st.floats(width=32), st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 3.4e38, -1.0, 1e-45]))
ENUMS = st.one_of(st.integers(-3, 8), st.sampled_from([-(2**31), 2**31 - 1]))
ROLES = st.one_of(st.sampled_from(["system", "user", "assistant", "", "tool", "USER", "user "]), st.text(max_size=8))
TEXT = st.text(max_size=300)


@st.composite
def valid_requests(draw) -> pb.GenerateRequest:
    """Requests the API accepts, given the test model (vocab 300, MASK_ID) and limits of 64."""
    req = pb.GenerateRequest(request_id=draw(st.text(max_size=20)))
    which = draw(st.sampled_from(["prompt", "token_ids", "chat"]))
    if which == "prompt":
        req.prompt = draw(st.text(min_size=1, max_size=40).filter(str.strip))
    elif which == "token_ids":
        ids = st.integers(0, 299).filter(lambda i: i != MASK_ID)
        req.token_ids.ids.extend(draw(st.lists(ids, min_size=1, max_size=40)))
    else:
        for role, content in draw(st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]),
                                                     st.text(max_size=20)), min_size=1, max_size=2)):
            req.chat.messages.add(role=role, content=content)
    if draw(st.booleans()):
        req.gen_length = draw(st.sampled_from([4, 8, 16, 32]))
        req.block_length = draw(st.sampled_from([b for b in (1, 2, 4, 8, 16, 32) if req.gen_length % b == 0]))
        blocks = req.gen_length // req.block_length
        req.steps = blocks * draw(st.integers(1, req.block_length))
    if draw(st.booleans()):
        req.temperature = draw(st.floats(0, 2, width=32))
    req.remasking = draw(st.integers(0, 4))
    rule = draw(st.sampled_from(["fixed", "threshold", "factor"]))
    if rule == "threshold":
        req.threshold = draw(st.floats(0, 1, exclude_min=True, width=32))
    elif rule == "factor":
        req.factor = draw(st.floats(0, 4, exclude_min=True, width=32))
    if draw(st.booleans()):
        req.cfg_scale = draw(st.floats(0, 2, width=32))
    if draw(st.booleans()):
        req.seed = draw(st.integers(0, 2**63 - 1))
    mode = draw(st.integers(0, 3))
    req.stream_options.mode = mode
    if mode == pb.STREAM_MODE_EVERY_K_STEPS:
        req.stream_options.every_k_steps = draw(st.integers(1, 100))
    return req


@st.composite
def wild_requests(draw) -> pb.GenerateRequest:
    """Anything the wire can carry."""
    req = pb.GenerateRequest(request_id=draw(st.one_of(st.just(""), st.text(max_size=140))))
    which = draw(st.sampled_from(["prompt", "token_ids", "chat", None]))
    if which == "prompt":
        req.prompt = draw(st.text(max_size=300))
    elif which == "token_ids":
        ids = st.one_of(st.integers(0, 320), st.sampled_from([EOS_ID, MASK_ID, U32, 2**31]), st.integers(0, U32))
        req.token_ids.ids.extend(draw(st.lists(ids, max_size=80)))
    elif which == "chat":
        for role, content in draw(st.lists(st.tuples(ROLES, st.text(max_size=60)), max_size=4)):
            req.chat.messages.add(role=role, content=content)
        if not req.chat.messages:
            req.chat.SetInParent()  # an empty conversation, still "set"
    for name in ("gen_length", "steps", "block_length"):
        if draw(st.booleans()):
            setattr(req, name, draw(UINT32S))
    for name in ("temperature", "threshold", "factor", "cfg_scale"):
        if draw(st.booleans()):
            setattr(req, name, draw(FLOATS))
    if draw(st.booleans()):
        req.seed = draw(st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 2**63 - 1, 2**63, 2**64 - 1])))
    req.remasking = draw(ENUMS)
    if draw(st.booleans()):
        req.stream_options.mode = draw(ENUMS)
        req.stream_options.every_k_steps = draw(UINT32S)
    return req


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    """A third valid, a third valid with one or two fields taken from a wild request (the
    edges of validity), a third wild."""
    kind = draw(st.sampled_from(["valid", "mutated", "wild"]))
    if kind == "wild":
        return draw(wild_requests())
    req = draw(valid_requests())
    if kind == "mutated":
        wild = draw(wild_requests())
        fields = ["request_id", "input", "gen_length", "steps", "block_length", "temperature", "remasking",
                  "threshold", "factor", "cfg_scale", "seed", "stream_options"]
        for name in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=2, unique=True)):
            if name == "input":
                req.ClearField("input")
                if (which := wild.WhichOneof("input")) == "prompt":
                    req.prompt = wild.prompt
                elif which is not None:
                    getattr(req, which).CopyFrom(getattr(wild, which))
            elif name in ("request_id", "remasking"):  # no presence: always copied
                setattr(req, name, getattr(wild, name))
            elif not wild.HasField(name):
                req.ClearField(name)
            elif name == "stream_options":
                req.stream_options.CopyFrom(wild.stream_options)
            else:
                setattr(req, name, getattr(wild, name))
    return req


def must_be_rejected(req: pb.GenerateRequest, max_gen_length: int) -> bool:
    """A few requests the API spec says are invalid whatever else they hold."""
    return (req.WhichOneof("input") is None
            or len(req.request_id) > 128
            or req.remasking not in pb.Remasking.values()
            or req.stream_options.mode not in pb.StreamMode.values()
            or any(req.HasField(f) and not math.isfinite(getattr(req, f))
                   for f in ("temperature", "threshold", "factor", "cfg_scale"))
            or (req.HasField("gen_length") and not 1 <= req.gen_length <= max_gen_length))


FUZZ_FIELDS = {"request_id", "input", "prompt", "token_ids", "chat", "messages", "gen_length", "steps",
               "block_length", "temperature", "remasking", "threshold", "factor", "cfg_scale", "seed", "stream_options"}
FUZZ_EXAMPLES = 150


def test_fuzzed_requests_never_crash_the_server_or_answer_internal(shared_server):
    """Hypothesis-built GenerateRequests (NaN/inf/huge floats, wrapped negative ints, unknown
    enums, random token ids and chat roles, no input) over the wire: each is answered OK with a
    well-formed stream, or INVALID_ARGUMENT naming real fields, or RESOURCE_EXHAUSTED. Never
    INTERNAL/UNKNOWN, never a dead server."""
    outcomes: collections.Counter = collections.Counter()
    channel = grpc.insecure_channel(shared_server.target)
    stub = pb_grpc.GenerationServiceStub(channel)
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    wedged: list[pb.GenerateRequest] = []

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(req=generate_requests())
    # adaptive decoding with fewer steps than tokens once killed the step loop (IndexError)
    @example(req=pb.GenerateRequest(prompt="hello", gen_length=4, steps=2, block_length=2, threshold=0.9))
    @example(req=pb.GenerateRequest(token_ids=pb.TokenIds(ids=[2**32 - 1]), seed=2**64 - 1, remasking=-1))
    def answer_cleanly(req: pb.GenerateRequest) -> None:
        assert not wedged, f"the server stopped answering after:\n{wedged[0]}"  # fail fast, don't wait again
        try:
            msgs = list(stub.Generate(req, timeout=15))
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                wedged.append(req)
            assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), \
                f"{code}: {e.details()}\nrequest: {req}\n{shared_server.log_tail(10)}"
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                violations = field_violations(e)
                assert violations, f"INVALID_ARGUMENT without BadRequest details: {e.details()}"
                assert {f.split("[")[0].split(".")[0] for f, _ in violations} <= FUZZ_FIELDS, violations
            outcomes[code.name] += 1
        else:
            assert not must_be_rejected(req, info.limits.max_gen_length), f"accepted an invalid request: {req}"
            check_stream(msgs, req.gen_length if req.HasField("gen_length") else info.defaults.gen_length)
            assert msgs[-1].usage.generated_tokens <= len(msgs[-1].tokens)
            outcomes["OK"] += 1
        assert shared_server.alive, shared_server.log_tail()

    try:
        answer_cleanly()
    finally:
        channel.close()
    print(f"\nfuzz: {sum(outcomes.values())} generated requests: {dict(outcomes)}")
    assert sum(outcomes.values()) >= FUZZ_EXAMPLES
    assert outcomes["OK"] > 0 and outcomes["INVALID_ARGUMENT"] > 0
    assert shared_server.alive and shared_server.health() == SERVING
    m = shared_server.metrics()
    assert not [k for k in m if k.startswith("celeris_requests_total{code=INTERNAL")], m
    assert m["celeris_queue_depth"] == 0 and m["celeris_running_requests"] == 0


# ---------------------------------------------------------------- gauges the autoscaler reads

async def test_queue_and_running_gauges_return_to_zero_when_every_request_is_cancelled(shared_server):
    async with grpc.aio.insecure_channel(shared_server.target) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        # 16 running, 4 queued: one client's share of places is 20, and calls past it would be refused
        # in whatever order they reach the server (one of the first four, once, in a CI run)
        calls = [stub.Generate(request(64, 64, seed=i), timeout=30) for i in range(20)]
        await asyncio.wait_for(asyncio.gather(*(c.read() for c in calls[:4])), 20)
        assert shared_server.metrics()["celeris_running_requests"] > 0
        for c in calls:
            c.cancel()
    deadline = time.monotonic() + 30  # a cancel reaches the server in milliseconds; 30 s means never
    while (m := shared_server.metrics())["celeris_queue_depth"] or m["celeris_running_requests"]:
        assert time.monotonic() < deadline, \
            f"nothing in flight, yet queue_depth={m['celeris_queue_depth']} running={m['celeris_running_requests']}"
        await asyncio.sleep(0.1)
