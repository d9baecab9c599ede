"""Nemotron-Labs-Diffusion through real servers: `celeris serve --model <folder>` names its family
and modes on GetModelInfo, /v1/models and the metrics; concurrent requests of every mode over gRPC,
self-speculation equal to autoregressive decoding with its accepted tokens per verify pass in
Usage; and self-speculation without the draft adapter refused by field."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from celeris.v1 import generation_pb2 as pb
from celeris.v1 import generation_pb2_grpc as pb_grpc
from celeris.engine.config import EngineConfig
from celeris.engine.llm import LLM
from tests.integration.conftest import collect, running_server
from tests.integration.server_process import ServerProcess, free_port
from tests.unit.families.nemotron_helpers import write_tiny_nemotron

G = 16
PROMPTS = [[17, 301, 45], [88, 5, 640, 31, 77, 402, 15, 9], [12, 33, 999, 4, 58, 61, 700, 13, 90, 210, 6]]
ENGINE = EngineConfig(max_batch=8, max_queue=16, max_prompt_tokens=64, max_gen_length=64)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_nemotron(tmp_path_factory.mktemp("nemotron"))


def request(prompt: list[int], mode: int, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), gen_length=G, block_length=8, steps=G, seed=0,
                              decoding=mode, **kw)


async def test_modes_side_by_side_and_self_speculation_equals_ar(folder):
    llm = LLM.load(folder, ENGINE)
    async with running_server(llm) as (_, stub, _):
        info = await stub.GetModelInfo(pb.GetModelInfoRequest())
        modes = (pb.DECODING_MODE_AR, pb.DECODING_MODE_LINEAR_SPEC, pb.DECODING_MODE_DIFFUSION)
        calls = [collect(stub.Generate(request(p, m, request_id=f"{i}-{m}")))
                 for i, p in enumerate(PROMPTS) for m in modes]
        results = await asyncio.gather(*calls)
    assert info.family == "causal" and info.architecture == "nemotron-labs-diffusion"
    assert list(info.decoding_modes) == ["diffusion", "ar", "linear_spec"]
    finals = [msgs[-1] for msgs in results]
    for i in range(len(PROMPTS)):
        ar, spec = finals[3 * i], finals[3 * i + 1]
        assert [t.id for t in spec.tokens] == [t.id for t in ar.tokens]
        # every pass accepts at least one token; the first token is the prefill's
        assert 1 <= spec.usage.verify_passes <= spec.usage.accepted_tokens <= G - 1
        assert ar.usage.verify_passes == 0
        assert finals[3 * i + 2].usage.forward_passes > 0


async def test_self_speculation_without_its_adapter_is_refused_by_field(tmp_path):
    llm = LLM.load(write_tiny_nemotron(tmp_path / "bare", adapter=False), ENGINE)
    async with running_server(llm) as (_, stub, _):
        info = await stub.GetModelInfo(pb.GetModelInfoRequest())
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub.Generate(request(PROMPTS[0], pb.DECODING_MODE_LINEAR_SPEC)))
        ok = await collect(stub.Generate(request(PROMPTS[0], pb.DECODING_MODE_AR)))  # the others still serve
    assert list(info.decoding_modes) == ["diffusion", "ar"]
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = status_pb2.Status.FromString(dict(e.value.trailing_metadata())["grpc-status-details-bin"])
    bad = error_details_pb2.BadRequest()
    status.details[0].Unpack(bad)
    assert [v.field for v in bad.field_violations] == ["decoding"]
    assert ok[-1].done


@pytest.mark.slow  # a server process: its start and warm-up
def test_celeris_serve_names_the_family_and_modes(folder, tmp_path):
    http = free_port()
    proc = ServerProcess(folder, tmp_path / "serve.log", "--http-port", str(http)).start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models", timeout=30) as r:
            card = json.loads(r.read())["data"][0]["celeris"]
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 16, "decoding": "linear_spec",
                           "block_length": 8}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{http}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            usage = json.loads(r.read())["usage"]
        with grpc.insecure_channel(proc.target) as channel:
            info = pb_grpc.GenerationServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        metrics = proc.metrics()
    finally:
        proc.close()
    assert card["family"] == "causal" and card["decoding_modes"] == ["diffusion", "ar", "linear_spec"]
    assert info.family == "causal" and "linear_spec" in info.decoding_modes
    assert usage["verify_passes"] >= 1 and usage["accepted_tokens"] >= usage["verify_passes"]
    assert metrics.get("celeris_verify_passes_total", 0) >= usage["verify_passes"]
