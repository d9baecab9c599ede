"""Typed engine errors. The server maps each to one gRPC status in `server/errors.py`."""

from __future__ import annotations

from dataclasses import dataclass


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


@dataclass(frozen=True)
class FieldViolation:
    field: str
    description: str


class InvalidRequest(EngineError):
    """The request is malformed; carries one violation per bad field."""

    def __init__(self, violations: list[FieldViolation]):
        self.violations = list(violations)
        super().__init__("; ".join(f"{v.field}: {v.description}" for v in self.violations))


class Overloaded(EngineError):
    """The admission queue is full; the caller should retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(EngineError):
    """The engine is loading, draining or stopped."""


class StepFailed(EngineError):
    """A batched step raised (a bug, or e.g. CUDA out of memory); its requests are ended."""


class ModelLoadError(EngineError):
    """A checkpoint folder is missing, malformed, or does not match the model."""
