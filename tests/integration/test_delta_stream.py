"""Delta streams (SNAPSHOT_FORMAT_DELTA) rebuild, message by message, exactly the full stream."""

from __future__ import annotations

import dataclasses

import pytest

from celeris.v1 import generation_pb2 as pb
from celeris_client.canvas import Canvas
from celeris_client.client import CelerisClient
from celeris_client.types import Snapshot
from celeris.engine.config import EngineConfig
from celeris.engine.llm import LLM
from tests.integration.conftest import collect, running_server
from tests.integration.live_server import live_server

MODES = [(pb.STREAM_MODE_UNSPECIFIED, 0), (pb.STREAM_MODE_EVERY_K_STEPS, 3), (pb.STREAM_MODE_BLOCK_COMPLETE, 0),
         (pb.STREAM_MODE_FINAL_ONLY, 0)]


def request(fmt: int, mode: int = pb.STREAM_MODE_UNSPECIFIED, k: int = 0, **kw) -> pb.GenerateRequest:
    base = dict(request_id="delta-test", prompt="It is a truth universally", gen_length=32, steps=16, block_length=8,
                seed=3, temperature=0.8)
    return pb.GenerateRequest(stream_options=pb.StreamOptions(mode=mode, every_k_steps=k, format=fmt), **(base | kw))


def same(s: Snapshot) -> Snapshot:
    return dataclasses.replace(s, elapsed_s=None)  # wall time is the one field that may differ


def rebuilt(msgs: list[pb.GenerateResponse]) -> list[Snapshot]:
    canvas = Canvas()
    return [same(canvas.snapshot(m)) for m in msgs]


def by_choice(snaps: list[Snapshot]) -> dict[int, list[Snapshot]]:
    """Each choice's snapshots in order (choices interleave as their events come)."""
    out: dict[int, list[Snapshot]] = {}
    for s in snaps:
        out.setdefault(s.choice, []).append(s)
    return out


@pytest.mark.parametrize("mode,k", MODES)
@pytest.mark.parametrize("extra", [{}, {"n": 2}, {"stop_token_ids": [7, 9, 11]}], ids=["n1", "n2", "stops"])
async def test_delta_stream_rebuilds_the_full_stream_step_by_step(serve, mode, k, extra):
    async with serve() as (_, stub, _):
        full = await collect(stub.Generate(request(pb.SNAPSHOT_FORMAT_UNSPECIFIED, mode, k, **extra)))
        delta = await collect(stub.Generate(request(pb.SNAPSHOT_FORMAT_DELTA, mode, k, **extra)))
    assert len(full) == len(delta)
    assert all(m.format == pb.SNAPSHOT_FORMAT_UNSPECIFIED and not m.updates and not m.HasField("layout")
               for m in full)  # the full format is as before formats existed
    assert all(m.format == pb.SNAPSHOT_FORMAT_DELTA for m in delta)
    firsts = {}
    for i, m in enumerate(delta):
        firsts.setdefault(m.choice, i)
        assert m.HasField("layout") == (firsts[m.choice] == i)
        if not m.done:
            assert not m.tokens and not m.text and len(m.updates) < 32
    want, got = by_choice([same(Snapshot.from_pb(m)) for m in full]), by_choice(rebuilt(delta))
    assert sorted(want) == list(range(extra.get("n", 1)))
    assert want == got  # ids, texts, masked flags, commits, confidences, text: every message of every choice


async def test_layout_describes_the_canvas(serve, tiny_llm):
    async with serve() as (_, stub, _):
        first = (await collect(stub.Generate(request(pb.SNAPSHOT_FORMAT_DELTA))))[0]
    lay = first.layout
    assert (lay.gen_length, lay.block_length, lay.num_blocks) == (32, 8, 4)
    assert lay.mask_token_id == tiny_llm.tokenizer.mask_id and lay.mask_text == "\u2592" and lay.prompt_tokens > 0
    assert {u.position for u in first.updates} >= set(first.committed_positions)


@pytest.mark.parametrize("mode,k", MODES[:2])
async def test_provisional_predictions_cover_the_blocks_masks_and_change_nothing(serve, tiny_llm, mode, k):
    async with serve() as (_, stub, _):
        full = await collect(stub.Generate(request(pb.SNAPSHOT_FORMAT_UNSPECIFIED, mode, k, n=2)))
        req = request(pb.SNAPSHOT_FORMAT_DELTA, mode, k, n=2)
        req.stream_options.provisional = True
        delta = await collect(stub.Generate(req))
    snaps = rebuilt(delta)
    # The stream is the same stream, predictions aside.
    assert by_choice([same(Snapshot.from_pb(m)) for m in full]) == \
        by_choice([dataclasses.replace(s, provisional=()) for s in snaps])
    shown = 0
    for m, s in zip(delta, snaps):
        if m.done:
            assert not m.provisional and s.provisional == ()
            continue
        block = range(s.block_index * 8, s.block_index * 8 + 8)
        # Exactly the masks left in the block being decoded (none once it completes), ascending.
        assert [p for p, _ in s.provisional] == [p for p in block if s.tokens[p].masked]
        for p, t in s.provisional:
            assert t.text == tiny_llm.tokenizer.token_text(t.id) and t.id != tiny_llm.tokenizer.mask_id
            assert 0 < t.confidence <= 1 and not t.masked  # low_confidence: the pick's probability
        shown += len(s.provisional)
    assert shown > 0


async def test_provisional_and_unknown_formats_are_refused(serve):
    import grpc

    delta = pb.SNAPSHOT_FORMAT_DELTA
    async with serve() as (_, stub, _):
        for opts, field in ((pb.StreamOptions(provisional=True), "only valid with SNAPSHOT_FORMAT_DELTA"),
                            (pb.StreamOptions(format=pb.SNAPSHOT_FORMAT_FULL, provisional=True), "only valid with"),
                            (pb.StreamOptions(format=delta, provisional=True, mode=pb.STREAM_MODE_FINAL_ONLY),
                             "needs messages sent within a block"),
                            (pb.StreamOptions(format=delta, provisional=True, mode=pb.STREAM_MODE_BLOCK_COMPLETE),
                             "needs messages sent within a block"),
                            (pb.StreamOptions(format=7), "unknown enum value 7")):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                req = request(0)
                req.stream_options.CopyFrom(opts)
                await collect(stub.Generate(req))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()


@pytest.fixture(scope="module")
def llm256(tiny_model_dir):
    return LLM.load(tiny_model_dir, EngineConfig(max_batch=4, max_queue=4, max_prompt_tokens=64, max_gen_length=256))


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
@pytest.mark.parametrize("gen", [64, 256])
async def test_delta_bytes_are_a_tenth_of_full_snapshots(llm256, gen):
    req = dict(gen_length=gen, steps=gen, block_length=32, temperature=0.0, seed=1)
    async with running_server(llm256) as (_, stub, _):
        full = await collect(stub.Generate(request(pb.SNAPSHOT_FORMAT_FULL, **req)))
        delta = await collect(stub.Generate(request(pb.SNAPSHOT_FORMAT_DELTA, **req)))
    # A reader that falls behind (a loaded machine) gets some steps folded into one message
    # (engine/loop/request_stream.py), so the two streams need not have the same number of messages:
    # compare bytes per message, and snapshots at the steps both streams sent.
    full_bytes, delta_bytes = sum(m.ByteSize() for m in full), sum(m.ByteSize() for m in delta)
    print(f"gen {gen}: {len(full)} / {len(delta)} messages, full {full_bytes} B, delta {delta_bytes} B "
          f"({100 * delta_bytes / full_bytes:.1f}%)")
    assert len(full) <= gen and len(delta) <= gen and min(len(full), len(delta)) >= gen // 4
    assert delta_bytes / len(delta) <= 0.10 * full_bytes / len(full)
    whole = {m.step: same(Snapshot.from_pb(m)) for m in full}
    shared = [snap for snap in rebuilt(delta) if snap.step in whole]
    assert len(shared) >= gen // 4
    # Every shared step shows the same canvas; a message lists the commits since the previous one
    # its stream sent, so where either stream folded steps there, only the canvas is compared.
    assert all(canvas(s) == canvas(whole[s.step]) for s in shared)
    unfolded = unfolded_steps(full) & unfolded_steps(delta)
    assert all(s == whole[s.step] for s in shared if s.step in unfolded)
    assert rebuilt(delta)[-1] == whole[full[-1].step]


def canvas(s: Snapshot) -> tuple:
    return s.text, tuple((t.id, t.text, t.masked) for t in s.tokens)


def unfolded_steps(msgs: list[pb.GenerateResponse]) -> set[int]:
    """Steps whose message follows the previous step's message (nothing folded into it)."""
    return {m.step for prev, m in zip(msgs, msgs[1:]) if m.step == prev.step + 1} | {msgs[0].step}


def test_the_client_asks_for_deltas_and_hands_out_the_same_snapshots(tiny_llm):
    knobs = dict(gen_length=32, steps=16, block_length=8, seed=5, temperature=0.7, n=2)
    with live_server(tiny_llm) as s, CelerisClient(s.grpc_target) as c:
        full = [same(x) for x in c.stream("Emma Woodhouse", stream_format="full", request_id="c", **knobs)]
        delta = [same(x) for x in c.stream("Emma Woodhouse", request_id="c", **knobs)]
        texts = [r.text for r in c.sample("Emma Woodhouse", 2, **{k: v for k, v in knobs.items() if k != "n"})]
        guessed = [x for x in c.stream("Emma Woodhouse", request_id="c", provisional=True, **knobs)]
    assert by_choice(full) == by_choice(delta) and sum(x.done for x in delta) == 2
    assert texts == [by_choice(delta)[k][-1].text for k in (0, 1)]
    assert not any(x.provisional for x in delta)  # only when asked
    assert by_choice([same(dataclasses.replace(x, provisional=())) for x in guessed]) == by_choice(delta)
    assert all(x.tokens[p].masked for x in guessed for p, _ in x.provisional)
    assert sum(len(x.provisional) for x in guessed) > 0
