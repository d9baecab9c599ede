"""Typed client errors and the retry policy.

Every failed call raises a `CelerisError` (or a subclass chosen by status code) carrying the
status code, the server's message, the google.rpc.BadRequest field violations and the
google.rpc.RetryInfo delay when the server sent them. `RetryPolicy` decides whether and how long
to wait before trying again: exponential backoff with full jitter, never sooner than the
server's RetryInfo delay when there is one. `RetryBudget` decides whether a retry may be sent at
all: gRPC's retry throttling, so that a burst of failing calls cannot multiply into a stampede.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from typing import Optional

import grpc
from google.rpc import error_details_pb2, status_pb2

STATUS_DETAILS_KEY = "grpc-status-details-bin"


@dataclass(frozen=True)
class FieldViolation:
    field: str
    description: str


class CelerisError(Exception):
    """A failed RPC: `code` is a grpc.StatusCode; `field_violations` name the bad request fields."""

    def __init__(self, code: grpc.StatusCode, message: str, field_violations: tuple[FieldViolation, ...] = (),
                 retry_after: Optional[float] = None):
        self.code, self.message = code, message
        self.field_violations, self.retry_after = tuple(field_violations), retry_after
        super().__init__(self.describe())

    def describe(self) -> str:
        lines = [f"{self.code.name}: {self.message}"]
        lines += [f"  {v.field}: {v.description}" for v in self.field_violations]
        return "\n".join(lines)


class InvalidArgument(CelerisError):
    """The request was rejected; see field_violations."""


class Overloaded(CelerisError):
    """RESOURCE_EXHAUSTED: the queue is full or a rate limit was hit; retry after `retry_after`."""


class Unavailable(CelerisError):
    """The server is loading, draining or unreachable."""


class Unauthenticated(CelerisError):
    """Missing or wrong bearer token."""


class DeadlineExceeded(CelerisError):
    """The call's deadline passed."""


_BY_CODE: dict[grpc.StatusCode, type[CelerisError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


def _rich_status(trailing_metadata) -> Optional[status_pb2.Status]:
    for key, value in trailing_metadata or ():
        if key == STATUS_DETAILS_KEY:
            return status_pb2.Status.FromString(value)
    return None


def error_from_rpc(err: grpc.RpcError) -> CelerisError:
    """Convert a sync or asyncio RpcError, parsing the google.rpc details in the trailers."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    message = (err.details() if hasattr(err, "details") else None) or str(err)
    violations: list[FieldViolation] = []
    retry_after = None
    status = _rich_status(err.trailing_metadata() if hasattr(err, "trailing_metadata") else None)
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations += [FieldViolation(v.field, v.description) for v in bad.field_violations]
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            retry_after = info.retry_delay.ToNanoseconds() / 1e9
    return _BY_CODE.get(code, CelerisError)(code, message, tuple(violations), retry_after)


# CANCELLED too: this client never cancels a call it is still reading (closing a stream ends it
# silently), so a CANCELLED it reads came from the other side: gRPC refusing a call that crossed a
# draining server's GOAWAY, before any handler ran (docs/limits.md, Shutdown). Except grpc's own
# local cancels, by these details: the application's, or its channel closed under the call.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED})
LOCAL_CANCEL_DETAILS = frozenset({"Locally cancelled by application!", "Channel closed!"})


def is_retryable(err: CelerisError) -> bool:
    """A failure worth another attempt (and counted against the retry budget)."""
    if err.code == grpc.StatusCode.CANCELLED and err.message in LOCAL_CANCEL_DETAILS:
        return False
    return err.code in RETRYABLE


@dataclass(frozen=True)
class RetryPolicy:
    """Retries for UNAVAILABLE, RESOURCE_EXHAUSTED and CANCELLED; attempts include the first call.
    `max_tokens` and `token_ratio` size the client's `RetryBudget` (gRPC's retryThrottling)."""

    max_attempts: int = 5
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    multiplier: float = 2.0
    max_retry_after_s: float = 30.0  # a longer server RetryInfo delay is not waited for
    max_tokens: float = 10.0
    token_ratio: float = 0.1

    def delay(self, err: CelerisError, attempt: int, rng: Optional[random.Random] = None) -> Optional[float]:
        """Seconds to wait before attempt `attempt + 1` (attempt counts from 1), or None to give up:
        exponential backoff with full jitter, and never sooner than the server's RetryInfo."""
        draw = rng.uniform if rng is not None else random.uniform
        if not is_retryable(err) or attempt >= self.max_attempts:
            return None
        cap = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempt - 1))
        backoff = draw(0, cap)  # "full jitter"
        if err.retry_after is None:
            return backoff
        if err.retry_after > self.max_retry_after_s:
            return None
        # The server's delay is a floor; our own jitter on top spreads clients the server told alike.
        return max(backoff, err.retry_after * draw(1.0, 1.2))

    def budget(self) -> RetryBudget:
        return RetryBudget(self.max_tokens, self.token_ratio)


class RetryBudget:
    """gRPC's retry throttling (gRFC A6), shared by every call of one client (one channel, one
    target): a token count starts at `max_tokens`; each failed attempt takes 1, each success
    gives back `token_ratio`; a retry is sent only while more than half the tokens are left.

    So a burst of N calls that all fail makes fewer than N + max_tokens / 2 + token_ratio * S
    attempts, S of them succeeding: with the defaults (10, 0.1) under 1.1 N + 5, however many of
    them run at once (docs/limits.md). Thread-safe: the sync client may be shared by threads."""

    def __init__(self, max_tokens: float = 10.0, token_ratio: float = 0.1):
        if not 0 < max_tokens <= 1000 or not 0 < token_ratio <= 1:
            raise ValueError("retry budget: max_tokens in (0, 1000], token_ratio in (0, 1]")
        self.max_tokens, self.token_ratio = float(max_tokens), float(token_ratio)
        self.tokens = self.max_tokens
        self._lock = threading.Lock()

    def succeeded(self) -> None:
        with self._lock:
            self.tokens = min(self.max_tokens, self.tokens + self.token_ratio)

    def failed(self) -> bool:
        """Record one failed attempt; whether a retry may follow it."""
        with self._lock:
            self.tokens = max(0.0, self.tokens - 1)
            return self.tokens > self.max_tokens / 2
