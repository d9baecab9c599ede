"""Bad input never reaches the model and never answers INTERNAL: INVALID_ARGUMENT + BadRequest."""

from __future__ import annotations

import math

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celeris.v1 import generation_pb2 as pb
from celeris.engine.errors import InvalidRequest
from celeris.server.grpc import convert
from tests.integration.conftest import collect, small


def violations(err: grpc.aio.AioRpcError) -> dict[str, str]:
    status = rpc_status.from_call(err)
    br = error_details_pb2.BadRequest()
    assert any(d.Unpack(br) for d in status.details), "no google.rpc.BadRequest detail"
    return {v.field: v.description for v in br.field_violations}


CASES = [  # (request overrides, field named, text in its description)
    (dict(prompt=""), "prompt", "empty"),
    (dict(prompt="word " * 200), "prompt", "limit is 64"),
    (dict(gen_length=12, block_length=8), "block_length", "multiple"),
    (dict(gen_length=16, block_length=8, steps=7), "steps", "multiple of the number of blocks"),
    (dict(steps=32), "steps", "[1, gen_length=16]"),
    (dict(steps=0), "steps", "[1,"),
    (dict(gen_length=128, steps=8, block_length=8), "gen_length", "[1, 64]"),
    (dict(gen_length=0), "gen_length", "[1, 64]"),
    (dict(temperature=-0.5), "temperature", ">= 0"),
    (dict(temperature=math.nan), "temperature", "finite"),
    (dict(temperature=math.inf), "temperature", "finite"),
    (dict(threshold=0.0), "threshold", "(0, 1]"),
    (dict(threshold=1.5), "threshold", "(0, 1]"),
    (dict(factor=-1.0), "factor", "> 0"),
    (dict(threshold=0.9, factor=1.0), "factor", "either"),
    (dict(cfg_scale=-1.0), "cfg_scale", ">= 0"),
    (dict(remasking=99), "remasking", "unknown enum"),
    (dict(seed=2**63), "seed", "2^63-1"),
    (dict(request_id="x" * 200), "request_id", "128"),
    (dict(prompt=None, token_ids=pb.TokenIds(ids=[])), "token_ids.ids", "empty"),
    (dict(prompt=None, token_ids=pb.TokenIds(ids=[10**6])), "token_ids.ids", "bad"),
    (dict(prompt=None, token_ids=pb.TokenIds(ids=[5, 3])), "token_ids.ids", "mask id"),
    (dict(prompt=None, chat=pb.ChatMessages(messages=[pb.ChatMessage(role="robot", content="hi")])),
     "chat.messages[0].role", "one of"),
    (dict(prompt=None, chat=pb.ChatMessages()), "chat.messages", "empty"),
    (dict(prompt=None), "input", "set one of"),
    (dict(stream_options=pb.StreamOptions(mode=pb.STREAM_MODE_EVERY_K_STEPS)), "stream_options.every_k_steps", ">= 1"),
    (dict(stream_options=pb.StreamOptions(mode=pb.STREAM_MODE_FINAL_ONLY, every_k_steps=2)),
     "stream_options.every_k_steps", "only valid"),
    (dict(stream_options=pb.StreamOptions(mode=42)), "stream_options.mode", "unknown enum"),
]


@pytest.mark.parametrize("overrides,field,text", CASES, ids=[f"{c[1]}-{i}" for i, c in enumerate(CASES)])
async def test_each_bad_field_is_named_with_its_limit(serve, tiny_llm, overrides, field, text):
    steps_before = tiny_llm.loop.steps
    async with serve() as (_, stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub.Generate(small(**overrides)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    v = violations(e.value)
    assert field in v and text in v[field], v
    assert tiny_llm.loop.steps == steps_before + 1  # only the warm-up: nothing reached the model


async def test_all_violations_reported_together(serve):
    async with serve() as (_, stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub.Generate(small(prompt="", gen_length=12, temperature=-1.0, threshold=2.0)))
    assert {"prompt", "block_length", "temperature", "threshold"} <= set(violations(e.value))


# ---------------------------------------------------------------- property test of the validation path

FLOATS = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True, width=32))
UINTS = st.one_of(st.none(), st.integers(0, 2**32 - 1))


@st.composite
def requests(draw) -> pb.GenerateRequest:
    kw = {}
    which = draw(st.sampled_from(["prompt", "token_ids", "chat", "none"]))
    if which == "prompt":
        kw["prompt"] = draw(st.text(max_size=80))
    elif which == "token_ids":
        kw["token_ids"] = pb.TokenIds(ids=draw(st.lists(st.integers(0, 2**32 - 1), max_size=20)))
    elif which == "chat":
        kw["chat"] = pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in draw(
            st.lists(st.tuples(st.sampled_from(["user", "assistant", "system", "", "bot"]), st.text(max_size=20)),
                     max_size=3))])
    for name in ("gen_length", "steps", "block_length"):
        if (v := draw(UINTS)) is not None:
            kw[name] = v
    for name in ("temperature", "threshold", "factor", "cfg_scale"):
        if (v := draw(FLOATS)) is not None:
            kw[name] = v
    if (seed := draw(st.one_of(st.none(), st.integers(0, 2**64 - 1)))) is not None:
        kw["seed"] = seed
    kw["remasking"] = draw(st.integers(0, 6))
    kw["request_id"] = draw(st.text(max_size=150))
    kw["stream_options"] = pb.StreamOptions(mode=draw(st.integers(0, 5)), every_k_steps=draw(st.integers(0, 4)))
    return pb.GenerateRequest(**kw)


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(req=requests())
def test_validation_accepts_or_rejects_cleanly(tiny_llm, req):
    """Every request either becomes a valid Sequence or raises InvalidRequest: nothing else."""
    try:
        convert.stream_plan(req)
        seq = tiny_llm.build(convert.engine_request(req, tiny_llm.defaults))
    except InvalidRequest as e:
        assert e.violations and all(v.field and v.description for v in e.violations)
        return
    p = seq.params
    assert 1 <= p.gen_length <= tiny_llm.config.max_gen_length and p.gen_length % p.block_length == 0
    assert 1 <= p.steps <= p.gen_length and p.steps % p.num_blocks == 0
    assert math.isfinite(p.temperature) and p.temperature >= 0
    assert p.threshold is None or 0 < p.threshold <= 1
    assert 0 < len(seq.prompt) <= tiny_llm.config.max_prompt_tokens
    assert all(0 <= t < tiny_llm.model_config.vocab_size and t != tiny_llm.tokenizer.mask_id for t in seq.prompt)
