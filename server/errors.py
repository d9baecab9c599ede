"""One table from engine errors to gRPC statuses, with google.rpc error details."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from engine.errors import EngineError, InvalidRequest, ModelLoadError, Overloaded, StepFailed, Unavailable

# engine error type -> (gRPC status code, google.rpc code)
STATUS_TABLE: dict[type, tuple[grpc.StatusCode, int]] = {
    InvalidRequest: (grpc.StatusCode.INVALID_ARGUMENT, code_pb2.INVALID_ARGUMENT),
    Overloaded: (grpc.StatusCode.RESOURCE_EXHAUSTED, code_pb2.RESOURCE_EXHAUSTED),
    Unavailable: (grpc.StatusCode.UNAVAILABLE, code_pb2.UNAVAILABLE),
    ModelLoadError: (grpc.StatusCode.UNAVAILABLE, code_pb2.UNAVAILABLE),
    StepFailed: (grpc.StatusCode.INTERNAL, code_pb2.INTERNAL),
}


def _pack(msg) -> any_pb2.Any:
    a = any_pb2.Any()
    a.Pack(msg)
    return a


def to_status(exc: EngineError) -> grpc.Status:
    """The rich status for an engine error (INTERNAL for anything not in the table: a bug)."""
    code, rpc_code = next(((c, r) for t, (c, r) in STATUS_TABLE.items() if isinstance(exc, t)),
                          (grpc.StatusCode.INTERNAL, code_pb2.INTERNAL))
    details = []
    if isinstance(exc, InvalidRequest):
        details.append(_pack(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
            for v in exc.violations])))
    if isinstance(exc, Overloaded):
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(exc.retry_after_s * 1e9))
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
    return rpc_status.to_status(status_pb2.Status(code=rpc_code, message=str(exc), details=details))


async def abort(context: grpc.aio.ServicerContext, exc: EngineError) -> None:
    """Abort the RPC with the error's status; raises, like context.abort."""
    await context.abort_with_status(to_status(exc))


def status_for_code(code: grpc.StatusCode, message: str) -> grpc.Status:
    rpc_code = getattr(code_pb2, code.name)
    return rpc_status.to_status(status_pb2.Status(code=rpc_code, message=message))
