"""LLaDA2.1 through a real gRPC server: token editing requested per call equals the published
loop, revisions show in the snapshots (a written position later holds another token), the delta
stream rebuilds the full one, and a LLaDA2.0 model refuses editing_threshold by name."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from celeris.v1 import generation_pb2 as pb
from celeris.engine.config import EngineConfig
from celeris.engine.llm import LLM
from tests.integration.conftest import collect, running_server
from tests.unit.block_references.checkpoints import (EOS_ID, MASK_ID, cut, write_llada2_checkpoint,
                                                     write_llada21_checkpoint)
from tests.unit.block_references.generate import llada21_generate
from tests.unit.block_references.modeling import load_block_model

G = 16
PROMPTS = [[17, 301, 45], [88, 5, 640, 31, 77, 402, 15, 9], [12, 33, 999, 4, 58, 61, 700, 13, 90, 210, 6]]


@pytest.fixture(scope="module")
def llada21(tmp_path_factory):
    folder = write_llada21_checkpoint(tmp_path_factory.mktemp("llada21"), seed=3)
    # No prefix cache: the delta test sends one prompt twice, and a second request that found the
    # first one's prompt blocks would skip the prefill step its full-stream twin showed.
    return folder, LLM.load(folder, EngineConfig(max_batch=8, max_queue=16, max_prompt_tokens=64, max_gen_length=64,
                                                 prefix_cache_bytes=0))


def request(prompt: list[int], **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), gen_length=G, block_length=4, steps=G,
                              threshold=0.5, editing_threshold=0.0, max_post_steps=3, seed=0, **kw)


@pytest.mark.slow  # ~12 s under load: three reference runs recompute their windows every step
async def test_concurrent_editing_requests_equal_the_published_loop_and_show_revisions(llada21):
    folder, llm = llada21
    async with running_server(llm) as (_, stub, _):
        results = await asyncio.gather(*(collect(stub.Generate(request(p, request_id=f"r{i}")))
                                         for i, p in enumerate(PROMPTS)))
    model = load_block_model(folder)
    revisions = 0
    for p, msgs in zip(PROMPTS, results):
        ref = llada21_generate(model, p, G, 4, threshold=0.5, editing_threshold=0.0, max_post_steps=3,
                               mask_id=MASK_ID, eos_id=EOS_ID)
        assert cut([t.id for t in msgs[-1].tokens], G) == cut(ref.ids, G)
        for before, after in zip(msgs, msgs[1:]):  # a position that held a token holds another one
            revisions += sum(a.id != b.id and not a.masked and not b.masked
                             for a, b in zip(before.tokens, after.tokens))
    assert revisions > 0


async def test_delta_stream_with_revisions_rebuilds_the_full_stream(llada21):
    from celeris_client.canvas import Canvas

    _, llm = llada21
    async with running_server(llm) as (_, stub, _):
        full = await collect(stub.Generate(request(PROMPTS[2], request_id="e",
                                                   stream_options=pb.StreamOptions(format=pb.SNAPSHOT_FORMAT_FULL))))
        delta = await collect(stub.Generate(request(PROMPTS[2], request_id="e", stream_options=pb.StreamOptions(
            format=pb.SNAPSHOT_FORMAT_DELTA))))
    # Both through the client's Canvas, which marks `revised` positions in either format.
    rebuilt, whole = Canvas(), Canvas()
    snaps = [dataclasses.replace(whole.snapshot(m), elapsed_s=None) for m in full]
    assert [dataclasses.replace(rebuilt.snapshot(m), elapsed_s=None) for m in delta] == snaps
    assert any(s.revised for s in snaps)
    final: set[int] = set()
    for s in snaps:  # a position shown final never changes afterwards
        assert not final & set(s.revised)
        final |= {i for i, t in enumerate(s.tokens) if t.final}


async def test_llada20_refuses_editing_threshold(tmp_path):
    llm = LLM.load(write_llada2_checkpoint(tmp_path / "m", seed=3),
                   EngineConfig(max_batch=2, max_prompt_tokens=64, max_gen_length=64))
    async with running_server(llm) as (_, stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub.Generate(request(PROMPTS[0])))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "editing_threshold" in e.value.details()
