"""Generate over a real server: streaming, stream modes, batching, cancellation, deadlines, overload."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from celeris.v1 import generation_pb2 as pb
from celeris.engine.config import EngineConfig
from celeris.engine.llm import LLM
from celeris.engine.sampling.params import SamplingParams
from tests.integration.conftest import collect, running_server, small

MASK = "\u2592"


async def test_generate_streams_snapshots_then_a_final_message(serve):
    async with serve() as (_, stub, _):
        msgs = await collect(stub.Generate(small(request_id="req-1")))
    assert len(msgs) == 8  # one snapshot per step
    assert all(m.request_id == "req-1" for m in msgs)
    assert [m.step for m in msgs] == list(range(1, 9))
    first, last = msgs[0], msgs[-1]
    assert MASK in first.text and not first.done and first.finish_reason == pb.FINISH_REASON_UNSPECIFIED
    assert len(first.tokens) == 16 and sum(t.masked for t in first.tokens) == 14  # 2 committed per step
    assert first.committed_positions and all(first.tokens[p].committed_this_step for p in first.committed_positions)
    assert len(first.committed_confidences) == len(first.committed_positions)
    assert not first.HasField("usage")
    assert last.done and last.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
    assert last.seed == 1 and last.usage.forward_passes == 8 and last.usage.prompt_tokens > 0
    assert MASK not in last.text
    assert sum(m.done for m in msgs) == 1


@pytest.mark.parametrize("mode,k,expected", [
    (pb.STREAM_MODE_FINAL_ONLY, 0, 1),
    (pb.STREAM_MODE_EVERY_K_STEPS, 3, 3),  # steps 3, 6, and the final 8th
    (pb.STREAM_MODE_BLOCK_COMPLETE, 0, 2),
])
async def test_stream_modes(serve, mode, k, expected):
    req = small(stream_options=pb.StreamOptions(mode=mode, every_k_steps=k), seed=5)
    async with serve() as (_, stub, _):
        msgs = await collect(stub.Generate(req))
    assert len(msgs) == expected and msgs[-1].done
    committed = sorted(p for m in msgs for p in m.committed_positions)
    assert committed == list(range(16))  # positions since the last message sent: none lost


async def test_final_text_matches_offline_engine(serve, tiny_llm):
    async with serve() as (_, stub, _):
        last = (await collect(stub.Generate(small(seed=9, temperature=0.7))))[-1]
    offline = tiny_llm.generate_one("It is a truth universally", SamplingParams(
        gen_length=16, steps=8, block_length=8, seed=9, temperature=0.7))
    assert last.text == offline.text and last.usage.generated_tokens == len(offline.token_ids)


async def test_sixteen_concurrent_streams_share_forwards_and_match_solo_runs(serve, tiny_llm):
    prompts = [f"{'Emma ' * (i % 5 + 1)}was {i}" for i in range(16)]
    async with serve() as (server, stub, _):
        steps_before = server.scheduler.steps
        results = await asyncio.gather(*(collect(stub.Generate(small(prompt=p, seed=i, temperature=0.5)))
                                         for i, p in enumerate(prompts)))
        forwards = server.scheduler.steps - steps_before
    total_request_steps = sum(r[-1].usage.forward_passes for r in results)
    assert total_request_steps == 16 * 8
    assert forwards < total_request_steps / 4  # batched: far fewer forwards than requests' steps
    for i, (p, msgs) in enumerate(zip(prompts, results)):
        solo = tiny_llm.generate_one(p, SamplingParams(gen_length=16, steps=8, block_length=8, seed=i, temperature=0.5))
        assert msgs[-1].text == solo.text


async def _wait_for(pred, timeout=10.0):
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.005)


async def test_client_cancel_frees_the_slot_within_one_step(serve):
    long = small(gen_length=64, steps=64, block_length=64)
    async with serve() as (server, stub, _):
        sched = server.scheduler
        seen_at: list[int] = []  # scheduler step count when the server learned of the cancel
        original = sched._close  # every door closes its stream when its client goes away
        sched._close = lambda stream: (seen_at.append(sched.steps), original(stream))[1]
        batches: list[tuple[str, ...]] = []  # request ids of every step, in order
        sched.on_step = lambda record: batches.append(record.request_ids)
        keepalive = stub.Generate(long)  # keeps the loop stepping while we cancel the other one
        victim = stub.Generate(small(gen_length=64, steps=64, block_length=64, seed=2, request_id="victim"))
        await victim.read()
        await _wait_for(lambda: sched.active == 2)
        victim.cancel()
        await _wait_for(lambda: bool(seen_at))
        await _wait_for(lambda: sched.running == 1 and len(batches) > seen_at[0] + 2)
        after = [b for b in batches[seen_at[0]:] if "victim" in b]
        assert len(after) <= 1  # at most the step already in flight; freed before the next one
        assert sched.active == 1
        keepalive.cancel()
        await _wait_for(lambda: sched.active == 0 and sched.running == 0 and sched.queued == 0)


async def test_deadline_exceeded_frees_the_slot(serve):
    async with serve() as (server, stub, _):
        call = stub.Generate(small(gen_length=64, steps=64, block_length=64), timeout=0.05)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(call)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await _wait_for(lambda: server.scheduler.active == 0 and server.llm.loop.idle)


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
async def test_overload_answers_resource_exhausted_with_retry_info_at_once(tiny_model_dir):
    llm = LLM.load(tiny_model_dir, EngineConfig(max_batch=2, max_queue=2, max_prompt_tokens=64, max_gen_length=64))
    async with running_server(llm, max_streams_per_client=0) as (server, stub, _):  # one client may take all
        calls = [stub.Generate(small(gen_length=64, steps=64, block_length=64, seed=i)) for i in range(8)]

        async def ending(call):  # (error or None, when the call ended)
            try:
                await collect(call)
            except grpc.aio.AioRpcError as e:
                return e, time.monotonic()
            return None, time.monotonic()

        ends = await asyncio.gather(*(ending(c) for c in calls))
        rejected = [e for e, _ in ends if e is not None]
        assert len(rejected) == 4  # 2 slots + 2 queue places admitted, the rest refused
        # refused at once, not once a place freed: before any admitted call had finished
        assert max(t for e, t in ends if e is not None) < min(t for e, t in ends if e is None)
        for e in rejected:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            info = error_details_pb2.RetryInfo()
            assert any(d.Unpack(info) for d in rpc_status.from_call(e).details)
            assert info.retry_delay.ToNanoseconds() > 0
        for c in calls:
            c.cancel()
        await _wait_for(lambda: server.scheduler.active == 0 and llm.loop.idle)


async def test_model_info_and_tokenize(serve, tiny_llm):
    async with serve() as (_, stub, _):
        info = await stub.GetModelInfo(pb.GetModelInfoRequest())
        tok = await stub.Tokenize(pb.TokenizeRequest(text="It is a truth"))
        chat = await stub.Tokenize(pb.TokenizeRequest(text="hi", apply_chat_template=True))
    assert info.vocab_size == tiny_llm.model_config.vocab_size and info.parameter_count > 0
    assert info.limits.max_batch == 16 and info.defaults.remasking == pb.REMASKING_LOW_CONFIDENCE
    assert list(tok.ids) == tiny_llm.tokenizer.encode("It is a truth") and len(tok.tokens) == len(tok.ids)
    assert len(chat.ids) > len(tiny_llm.tokenizer.encode("hi"))


async def test_chat_and_token_id_inputs(serve, tiny_llm):
    ids = tiny_llm.tokenizer.encode("It is a truth")
    async with serve() as (_, stub, _):
        by_ids = (await collect(stub.Generate(small(prompt=None, token_ids=pb.TokenIds(ids=ids)))))[-1]
        by_text = (await collect(stub.Generate(small(prompt="It is a truth"))))[-1]
        chat = (await collect(stub.Generate(small(prompt=None, chat=pb.ChatMessages(
            messages=[pb.ChatMessage(role="user", content="Hello")])))))[-1]
    assert by_ids.text == by_text.text
    assert chat.done and chat.usage.prompt_tokens > 1
