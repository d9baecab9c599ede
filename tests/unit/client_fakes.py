"""Fake gRPC calls, stubs and errors for the client library's retry tests."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

from celeris.v1 import generation_pb2 as pb
from celeris_client import CelerisClient, RetryPolicy


FAST = RetryPolicy(max_attempts=3, initial_backoff_s=0.001, max_backoff_s=0.002)  # retries without waiting


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "", *detail_msgs):
        self._code, self._details = code, details
        anys = []
        for m in detail_msgs:
            a = any_pb2.Any()
            a.Pack(m)
            anys.append(a)
        status = status_pb2.Status(code=code.value[0], message=details, details=anys)
        self._trailing = (("grpc-status-details-bin", status.SerializeToString()),)

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing


def retry_info(seconds: float) -> error_details_pb2.RetryInfo:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return error_details_pb2.RetryInfo(retry_delay=d)


class FakeCall:
    """A Generate call: yields `messages`, then raises `error` if given."""

    def __init__(self, messages, error=None):
        self.messages, self.error, self.cancelled = messages, error, False

    def __iter__(self):
        yield from self.messages
        if self.error is not None:
            raise self.error

    def cancel(self):
        self.cancelled = True


class FakeStub:
    def __init__(self, calls):
        self.calls, self.made = list(calls), []

    def Generate(self, request, timeout=None, metadata=()):
        self.made.append((request, timeout, metadata))
        return self.calls.pop(0)


def snap(step: int, done: bool = False) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id="r", step=step, total_steps=2, num_blocks=1, text="ab", done=done,
                               tokens=[pb.Token(id=5, text="a"), pb.Token(id=3, text="▒", masked=not done)])


def client_with(calls, **kw) -> tuple[CelerisClient, FakeStub]:
    c = CelerisClient("127.0.0.1:1", retry=FAST, **kw)
    c._stub = FakeStub(calls)
    return c, c._stub
