"""gRPC health Watch streams are capped (#40: one client held 3,208 of them, +70 MiB): in all and
per client address, RESOURCE_EXHAUSTED beyond; Check is never limited, and neither needs a key."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from celeris.server.health import MAX_WATCHES_PER_CLIENT, SERVICE_NAME

SERVING = health_pb2.HealthCheckResponse.SERVING
REQ = health_pb2.HealthCheckRequest(service=SERVICE_NAME)


async def open_watch(stub: health_pb2_grpc.HealthStub):
    """A Watch stream that has answered its first status (so the server counts it)."""
    call = stub.Watch(REQ)
    first = await call.read()
    assert first.status == SERVING
    return call


async def refused(stub: health_pb2_grpc.HealthStub) -> grpc.aio.AioRpcError:
    call = stub.Watch(REQ)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
    return err.value


async def test_one_client_holds_at_most_its_share_of_watch_streams_by_default(serve):
    async with serve() as (server, _, port):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            calls = [await open_watch(stub) for _ in range(MAX_WATCHES_PER_CLIENT)]
            err = await refused(stub)
            assert "from one client" in err.details() and "--max-health-watches-per-client" in err.details()
            assert (await stub.Check(REQ)).status == SERVING  # probes still answered
            calls.pop().cancel()
            calls.append(await open_watch(stub))  # a closed one frees its place
            for c in calls:
                c.cancel()


async def test_watch_streams_in_all_are_capped_and_need_no_key(serve):
    """Three clients' worth of streams from one address count against the total first; with
    --api-key set, Watch (like Check) is served without one: health callers carry no token."""
    async with serve(max_health_watches=3, api_token="s3cret") as (server, _, port):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            calls = [await open_watch(stub) for _ in range(3)]
            err = await refused(stub)
            assert "in all" in err.details() and "--max-health-watches" in err.details()
            assert (await stub.Check(REQ)).status == SERVING
            for c in calls:
                c.cancel()
            await open_watch(stub)
        await server.stop(drain_seconds=0, grace_seconds=1)
        assert not server.health.servicer.open_watches  # every stream's place came back
