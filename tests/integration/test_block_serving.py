"""Block-diffusion models through a real gRPC server: 16 concurrent requests at different blocks
each equal the published loop's tokens, and every stream mode ends with the same final message."""

from __future__ import annotations

import asyncio

import pytest

from celeris.v1 import generation_pb2 as pb
from celeris.engine.config import EngineConfig
from celeris.engine.llm import LLM
from tests.integration.conftest import collect, running_server
from tests.unit.block_references.checkpoints import EOS_ID, MASK_ID, write_llada2_checkpoint, write_sdar_checkpoint
from tests.unit.block_references.generate import llada2_generate, sdar_generate
from tests.unit.block_references.modeling import load_block_model

G = 16


def prompts(n: int) -> list[list[int]]:
    """n prompts of 1..n tokens: requests start at different blocks and prefill different amounts."""
    return [[5 + (7 * i + 13 * j) % 1000 for j in range(i + 1)] for i in range(n)]


def generated(msg: pb.GenerateResponse) -> list[int]:
    out = []
    for t in msg.tokens:
        if t.id in (EOS_ID, MASK_ID):
            break
        out.append(t.id)
    return out


@pytest.fixture(scope="module", params=["sdar", "llada2"])
def block_model(request, tmp_path_factory):
    write = write_sdar_checkpoint if request.param == "sdar" else write_llada2_checkpoint
    folder = write(tmp_path_factory.mktemp(request.param), seed=0)
    llm = LLM.load(folder, EngineConfig(max_batch=16, max_queue=32, max_prompt_tokens=64, max_gen_length=64))
    return request.param, folder, llm


def reference(kind: str, folder, prompt: list[int], block_length: int, spb: int, threshold: float) -> list[int]:
    model = load_block_model(folder)
    if kind == "sdar":
        ids = sdar_generate(model, prompt, G, block_length, spb, remasking="low_confidence_dynamic",
                            threshold=threshold, mask_id=MASK_ID, stop_ids=[EOS_ID]).ids
    else:
        ids = llada2_generate(model, prompt, G, block_length, spb, threshold=threshold, mask_id=MASK_ID,
                              eos_id=EOS_ID).ids
    if MASK_ID in ids[:G]:  # the random model ranked the mask token first: Celeris never commits it
        return None
    out = []
    for t in ids[:G]:
        if t == EOS_ID:
            break
        out.append(t)
    return out


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
async def test_sixteen_concurrent_requests_at_different_blocks_equal_the_published_loop(block_model):
    kind, folder, llm = block_model
    block_length, spb, threshold = 4, 4, 0.3
    ps = prompts(16)
    async with running_server(llm) as (server, stub, _):
        calls = [stub.Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=p), gen_length=G, block_length=block_length, steps=spb * G // block_length,
            threshold=threshold, seed=i, request_id=f"r{i}")) for i, p in enumerate(ps)]
        results = await asyncio.gather(*(collect(c) for c in calls))
        steps = server.scheduler.steps
    compared = 0
    for p, msgs in zip(ps, results):
        assert msgs[-1].done and sum(m.done for m in msgs) == 1
        expected = reference(kind, folder, p, block_length, spb, threshold)
        if expected is not None:
            assert generated(msgs[-1]) == expected
            compared += 1
    assert compared >= 12
    total = sum(msgs[-1].usage.forward_passes for msgs in results)
    assert steps < total / 4  # batched: one step served many requests at once


@pytest.mark.parametrize("mode", [pb.STREAM_MODE_UNSPECIFIED, pb.STREAM_MODE_BLOCK_COMPLETE, pb.STREAM_MODE_FINAL_ONLY])
async def test_every_stream_mode_ends_with_the_same_final_message(block_model, mode):
    _, _, llm = block_model
    req = pb.GenerateRequest(prompt="It is a truth universally", gen_length=G, block_length=4, steps=G, seed=3,
                             stream_options=pb.StreamOptions(mode=mode))
    async with running_server(llm) as (_, stub, _):
        msgs = await collect(stub.Generate(req))
        plain = await collect(stub.Generate(pb.GenerateRequest(prompt="It is a truth universally", gen_length=G,
                                                               block_length=4, steps=G, seed=3)))
    assert msgs[-1].text == plain[-1].text and msgs[-1].finish_reason == plain[-1].finish_reason
    assert len(msgs[-1].tokens) == G
    if mode == pb.STREAM_MODE_FINAL_ONLY:
        assert len(msgs) == 1
    if mode == pb.STREAM_MODE_BLOCK_COMPLETE:
        assert len(msgs) <= G // 4 + 2


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
async def test_delta_stream_of_a_block_model_rebuilds_the_full_stream(block_model):
    """Block models decode past gen_length and run prefill/store steps that commit nothing:
    the delta stream still rebuilds every full message."""
    import dataclasses

    from celeris_client.canvas import Canvas
    from celeris_client.types import Snapshot

    _, _, llm = block_model

    def req(fmt: int) -> pb.GenerateRequest:
        return pb.GenerateRequest(request_id="blocks", prompt="It is a truth universally", gen_length=G,
                                  block_length=4, steps=G, seed=3, temperature=0.7,
                                  stream_options=pb.StreamOptions(format=fmt))

    async with running_server(llm) as (_, stub, _):
        full = await collect(stub.Generate(req(pb.SNAPSHOT_FORMAT_FULL)))
        delta = await collect(stub.Generate(req(pb.SNAPSHOT_FORMAT_DELTA)))
    canvas = Canvas()
    assert [dataclasses.replace(canvas.snapshot(m), elapsed_s=None) for m in delta] == \
        [dataclasses.replace(Snapshot.from_pb(m), elapsed_s=None) for m in full]
    assert delta[0].layout.gen_length == G and not delta[0].tokens
