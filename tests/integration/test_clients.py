"""The Python client (sync and asyncio) against a real in-process server on port 0."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from celeris_client import (AsyncCelerisClient, CelerisClient, DeadlineExceeded, InvalidArgument, Overloaded, RetryPolicy,
                     Unauthenticated)
from tests.integration.live_server import live_server

SMALL = dict(gen_length=16, steps=8, block_length=8, seed=1)


@pytest.fixture
def live(tiny_llm):
    with live_server(tiny_llm) as s:
        yield s


def test_stream_snapshots_refine_the_canvas(live):
    with CelerisClient(live.grpc_target) as c:
        snaps = list(c.stream("It is a truth", **SMALL))
    assert len(snaps) >= 2 and snaps[-1].done and not any(s.done for s in snaps[:-1])
    assert [s.step for s in snaps] == list(range(1, len(snaps) + 1))
    masked = [s.masked_count for s in snaps]
    assert masked[0] > 0 and masked == sorted(masked, reverse=True)
    assert all(len(s.tokens) == 16 and s.num_blocks == 2 for s in snaps)
    first = snaps[0]
    assert first.committed_positions and all(first.tokens[p].committed_this_step for p in first.committed_positions)
    last = snaps[-1]
    assert last.finish_reason in ("stop", "length") and last.seed == 1 and last.usage.forward_passes == last.step
    assert last.elapsed_s > 0 and last.usage.prompt_tokens > 0


def test_generate_matches_the_streams_last_snapshot(live):
    with CelerisClient(live.grpc_target) as c:
        streamed = list(c.stream("It is a truth", **SMALL))[-1]
        result = c.generate("It is a truth", **SMALL)
    assert result.text == streamed.text and result.finish_reason == streamed.finish_reason
    assert result.usage == streamed.usage and result.seed == 1 and result.steps == streamed.step


def test_model_info_tokenize_and_chat(live, tiny_llm):
    with CelerisClient(live.grpc_target) as c:
        info = c.model_info()
        assert info.name == tiny_llm.name and info.limits.max_gen_length == 64 and info.dtype == "float32"
        assert info.defaults.remasking == "low_confidence"
        tok = c.tokenize("hello world")
        assert list(tok.ids) == tiny_llm.tokenizer.encode("hello world") and len(tok.tokens) == len(tok.ids)
        chat = c.generate([{"role": "user", "content": "hi"}], **SMALL)
        assert chat.usage.prompt_tokens > len(c.tokenize("hi").ids)  # the chat template was applied


def test_invalid_argument_names_every_field(live):
    with CelerisClient(live.grpc_target) as c, pytest.raises(InvalidArgument) as e:
        c.generate("x", gen_length=16, block_length=5, steps=99)
    fields = {v.field for v in e.value.field_violations}
    assert {"block_length", "steps"} <= fields and e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_deadline_exceeded(live):
    with CelerisClient(live.grpc_target) as c, pytest.raises(DeadlineExceeded):
        c.generate("x", gen_length=64, steps=64, block_length=64, timeout=0.005)


def test_retries_resource_exhausted_after_retry_info(tiny_llm):
    # One call per second, burst 1: the second call is refused with RetryInfo(~1 s) and retried.
    with live_server(tiny_llm, rate_limit=1.0, rate_burst=1) as s, CelerisClient(s.grpc_target) as c:
        c.model_info()
        t0 = time.perf_counter()
        assert c.model_info().name == tiny_llm.name
        assert time.perf_counter() - t0 >= 0.9  # waited as told, not the 0.1 s initial backoff
        with CelerisClient(s.grpc_target, retry=RetryPolicy(max_attempts=1)) as impatient:
            with pytest.raises(Overloaded) as e:
                impatient.model_info()
        assert e.value.retry_after > 0.5


def test_bearer_token(tiny_llm):
    with live_server(tiny_llm, api_token="s3cret") as s:
        with CelerisClient(s.grpc_target) as anonymous, pytest.raises(Unauthenticated):
            anonymous.model_info()
        with CelerisClient(s.grpc_target, token="s3cret") as c:
            assert c.generate("x", **SMALL).usage.generated_tokens >= 0


def test_async_client_stream_generate_and_cancel(live, tiny_llm, monkeypatch):
    async def scenario() -> int:
        async with AsyncCelerisClient(live.grpc_target) as c:
            assert (await c.model_info()).name == tiny_llm.name
            snaps = [s async for s in c.stream("It is a truth", **SMALL)]
            result = await c.generate("It is a truth", **SMALL)
            assert result.text == snaps[-1].text and snaps[-1].done
            real_step = tiny_llm.loop.step_later  # the step worker's call; 64 steps > 0.6 s
            monkeypatch.setattr(tiny_llm.loop, "step_later", lambda during=None: time.sleep(0.01) or real_step(during))
            steps_before = live.scheduler.steps
            stream = c.stream("It is a truth", gen_length=64, steps=64, block_length=64)
            first = await anext(stream)
            assert first.step == 1 and not first.done
            await stream.aclose()  # leaving early cancels the request on the server
            return steps_before

    steps_before = asyncio.run(scenario())
    deadline = time.monotonic() + 10
    while live.active() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert live.active() == 0 and live.scheduler.steps - steps_before < 64
