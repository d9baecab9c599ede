"""Standard grpc.health.v1: NOT_SERVING until the model is loaded and warmed up, and again
while draining. The overall ("") status and the service's own name are kept in step."""

from __future__ import annotations

from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

SERVICE_NAME = "celeris.v1.GenerationService"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Health:
    def __init__(self) -> None:
        self.servicer = HealthServicer()
        self.serving = False

    async def set(self, serving: bool) -> None:
        self.serving = serving
        status = SERVING if serving else NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.servicer.set(name, status)
