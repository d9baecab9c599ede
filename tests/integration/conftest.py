"""A real in-process server on a free port, per test, over the session's tiny model."""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

import grpc
import pytest

from celeris.v1 import generation_pb2 as pb
from celeris.v1 import generation_pb2_grpc as pb_grpc
from celeris.server.app import create_server
from celeris.server.settings import ServerSettings


@contextlib.asynccontextmanager
async def running_server(llm, telemetry=None, **settings) -> AsyncIterator[tuple[object, pb_grpc.GenerationServiceStub, int]]:
    settings = {"port": 0, "host": "127.0.0.1", "drain_seconds": 0.0, "grace_seconds": 5.0} | settings
    server, port = await create_server(llm, ServerSettings(**settings), telemetry)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield server, pb_grpc.GenerationServiceStub(channel), port
    finally:
        if server.grpc is not None and not server._stopped.is_set():
            await server.stop(drain_seconds=0, grace_seconds=1)
        assert llm.loop.idle, "a test left requests in the shared engine"


@pytest.fixture
def spawn(tiny_model_dir, tmp_path):
    """spawn(*flags, **ServerProcess options) starts a `celeris serve` process; all are killed at the end."""
    from tests.integration.server_process import ServerProcess

    procs = []

    def start(*flags: str, **kw):
        p = ServerProcess(tiny_model_dir, tmp_path / f"server-{len(procs)}.log", *flags, **kw)
        procs.append(p)
        return p.start()

    yield start
    for p in procs:
        p.close()


@pytest.fixture
def serve(tiny_llm):
    """`async with serve(**settings) as (server, stub, port)`."""
    return lambda telemetry=None, **kw: running_server(tiny_llm, telemetry, **kw)


def small(**kw) -> pb.GenerateRequest:
    base = dict(prompt="It is a truth universally", gen_length=16, steps=8, block_length=8, seed=1)
    return pb.GenerateRequest(**(base | kw))


async def collect(call) -> list[pb.GenerateResponse]:
    """Every message of a stream, through read() so it mixes with earlier read() calls."""
    out = []
    while (m := await call.read()) is not grpc.aio.EOF:
        out.append(m)
    return out
