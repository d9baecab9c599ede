"""Standard grpc.health.v1: NOT_SERVING until the model is loaded and warmed up, and again
while draining. The overall ("") status and the service's own name are kept in step.

`Watch` streams are capped: each one stays open for as long as its client likes and holds
about 22 KiB (one client held 3,208 of them, +70 MiB, #40). Past `max_watches` open in all, or
`max_watches_per_client` from one address, a new Watch gets RESOURCE_EXHAUSTED at once.

Check and Watch need no API key, with or without --api-key: the callers of health are Kubernetes'
gRPC probes, grpc-health-probe, meshes and gRPC's own client-side health checking, which calls
Watch from inside the channel without the per-call metadata that carries a bearer token. Health
says SERVING or NOT_SERVING, nothing more; what a keyless caller could take is memory, and the cap
bounds that.
"""

from __future__ import annotations

import collections

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from celeris.server.guard import peer_address

SERVICE_NAME = "celeris.v1.GenerationService"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
MAX_WATCHES = 256  # open Watch streams in all (about 6 MiB)
MAX_WATCHES_PER_CLIENT = 32  # from one address: a client's channels each watch once per connection


class CappedHealthServicer(HealthServicer):
    """grpc_health's servicer with a bound on open Watch streams, in all and per client address."""

    def __init__(self, max_watches: int = MAX_WATCHES, max_watches_per_client: int = MAX_WATCHES_PER_CLIENT):
        super().__init__()
        self.max_watches, self.max_watches_per_client = max_watches, max_watches_per_client
        self.open_watches: collections.Counter[str] = collections.Counter()  # by client address

    async def Watch(self, request: health_pb2.HealthCheckRequest, context) -> None:
        client = peer_address(context.peer())[:64]
        total = sum(self.open_watches.values())
        if total >= self.max_watches or self.open_watches[client] >= self.max_watches_per_client:
            limit = (f"{self.max_watches} open health Watch streams in all (--max-health-watches)"
                     if total >= self.max_watches else f"{self.max_watches_per_client} open health Watch streams "
                     "from one client (--max-health-watches-per-client)")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{limit}; close one, or use Check")
        self.open_watches[client] += 1
        try:
            await super().Watch(request, context)
        finally:
            self.open_watches[client] -= 1
            if not self.open_watches[client]:
                del self.open_watches[client]


class Health:
    def __init__(self, max_watches: int = MAX_WATCHES, max_watches_per_client: int = MAX_WATCHES_PER_CLIENT) -> None:
        self.servicer = CappedHealthServicer(max_watches, max_watches_per_client)
        self.serving = False

    async def set(self, serving: bool) -> None:
        self.serving = serving
        status = SERVING if serving else NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.servicer.set(name, status)
