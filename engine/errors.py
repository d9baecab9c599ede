"""Typed engine errors. The server maps each to one gRPC status in `server/errors.py`."""

from __future__ import annotations

import reprlib
from dataclasses import dataclass

MAX_ECHO = 64  # characters of a client's value repeated back in an error or a log line
MAX_VIOLATIONS = 16  # violations reported per request; the rest are counted


def clip(value: object, limit: int = MAX_ECHO) -> str:
    """repr() of a client-supplied value, cut to `limit` characters: errors and logs must not
    grow with what a client sends."""
    r = reprlib.Repr()  # bounded work too: deep nesting and long lists are cut while rendering
    r.maxstring = r.maxother = r.maxlong = limit
    r.maxlevel, r.maxlist, r.maxdict, r.maxtuple = 3, 8, 8, 8
    text = r.repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


@dataclass(frozen=True)
class FieldViolation:
    field: str
    description: str


class InvalidRequest(EngineError):
    """The request is malformed; carries one violation per bad field."""

    def __init__(self, violations: list[FieldViolation]):
        violations = list(violations)
        if len(violations) > MAX_VIOLATIONS:
            more = len(violations) - MAX_VIOLATIONS + 1
            violations = violations[:MAX_VIOLATIONS - 1] + [FieldViolation("...", f"and {more} more violations")]
        self.violations = violations
        super().__init__("; ".join(f"{v.field}: {v.description}" for v in self.violations))


class Overloaded(EngineError):
    """The admission queue is full; the caller should retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(EngineError):
    """The engine is loading, draining or stopped."""


class StreamAbandoned(EngineError):
    """The client read nothing from its stream for the unread timeout: its request was cancelled
    (engine/loop/request_stream.py)."""


class StepFailed(EngineError):
    """A batched step raised (a bug, or e.g. CUDA out of memory); its requests are ended."""


class RowFailed(StepFailed):
    """One request's own part of a step failed (non-finite logits in its row, its stop-string
    check raised): that request alone ends with this error and the batch steps on. Its message
    names only this request's own state, never another request's input."""


def row_error(exc: BaseException) -> EngineError:
    """The typed error a request ends with when its own row-level work raised: an EngineError
    as it is (e.g. InvalidRequest naming its structured-output field), anything else as
    RowFailed naming only the exception's type (its text may quote any request's state)."""
    if isinstance(exc, EngineError):
        return exc
    return RowFailed(f"this request's step failed ({type(exc).__name__}); the other requests were not affected")


class ModelLoadError(EngineError):
    """A checkpoint folder is missing, malformed, or does not match the model."""
