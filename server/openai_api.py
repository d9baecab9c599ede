"""The only OpenAI JSON <-> engine mapping, for the HTTP gateway (as convert.py is for protobuf).

Requests: `parse_request` reads a /v1/completions or /v1/chat/completions body into an engine
prompt plus SamplingParams. `max_tokens` is the canvas length (gen_length); when it is given
without the diffusion fields, block_length and steps are fitted to it so that a plain OpenAI
client never trips over "gen_length must be a multiple of block_length". Extension fields:
steps, block_length, threshold, factor, cfg_scale, remasking, and `diffusing` (stream snapshots).

Errors: `error_response` is the HTTP table: InvalidRequest 400 (param named), Overloaded 429,
Unavailable 503, anything else 500 — bodies in OpenAI's {"error": {...}} shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

from engine.errors import EngineError, FieldViolation, InvalidRequest, ModelLoadError, Overloaded, Unavailable
from engine.params import SamplingParams
from server.convert import CHAT_ROLES

INTS = ("max_tokens", "max_completion_tokens", "steps", "block_length", "seed", "n", "best_of")
FLOATS = ("temperature", "threshold", "factor", "cfg_scale")
# OpenAI parameters whose non-default values we cannot honour: rejected, never silently ignored.
UNSUPPORTED = {"n": 1, "best_of": 1, "echo": False, "suffix": None, "stop": None, "logprobs": None,
               "tools": None, "functions": None}


@dataclass(frozen=True)
class GatewayRequest:
    chat: bool
    prompt: Union[str, list[int]]  # ignored for chat
    messages: Optional[list[dict]]
    params: SamplingParams
    stream: bool
    diffusing: bool
    length_param: str  # the name the client used for the length (for error messages)


def _typed(body: dict, v: list[FieldViolation]) -> dict[str, Any]:
    """Type-check the numeric and boolean fields; return those present and well typed."""
    out: dict[str, Any] = {}
    for name in INTS + FLOATS:
        x = body.get(name)
        if x is None:
            continue
        ok = isinstance(x, int) if name in INTS else isinstance(x, (int, float)) and math.isfinite(x)
        if isinstance(x, bool) or not ok:
            v.append(FieldViolation(name, f"must be {'an integer' if name in INTS else 'a finite number'}, got {x!r}"))
        else:
            out[name] = x
    for name in ("stream", "diffusing"):
        if not isinstance(body.get(name, False), bool):
            v.append(FieldViolation(name, f"must be a boolean, got {body[name]!r}"))
    if "remasking" in body and not isinstance(body["remasking"], str):
        v.append(FieldViolation("remasking", f"must be a string, got {body['remasking']!r}"))
    return out


def _unsupported(body: dict, v: list[FieldViolation]) -> None:
    for name, default in UNSUPPORTED.items():
        x = body.get(name, default)
        if x != default and not (name == "logprobs" and x is False) and not (name == "stop" and x == []):
            v.append(FieldViolation(name, f"is not supported by this server (only {default!r})"))


def _prompt(body: dict, v: list[FieldViolation]) -> Union[str, list[int]]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        return p
    if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return list(p)
    v.append(FieldViolation("prompt", "must be a string or a list of token ids (one prompt per request)"))
    return ""


def _messages(body: dict, v: list[FieldViolation]) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        v.append(FieldViolation("messages", "must be a non-empty list of {role, content} objects"))
        return []
    out = []
    for i, m in enumerate(msgs):
        role = m.get("role") if isinstance(m, dict) else None
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if role not in CHAT_ROLES:
            v.append(FieldViolation(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}, got {role!r}"))
        elif not isinstance(content, (str, type(None))):
            v.append(FieldViolation(f"messages[{i}].content", "must be a string or a list of text parts"))
        else:
            out.append({"role": role, "content": content or ""})
    return out


def fit_schedule(gen_length: int, d: SamplingParams, block: Optional[int] = None) -> tuple[int, int]:
    """(block_length, steps) for a client-chosen gen_length, keeping the defaults' shape: the given
    block, else the default block length if it divides gen_length, else a divisor not far below it,
    else one block; and the defaults' tokens-per-step ratio, a whole number of steps per block."""
    if block is None:
        block = gen_length
        if gen_length > d.block_length:
            block = next((b for b in range(d.block_length, max(1, d.block_length // 4) - 1, -1)
                          if gen_length % b == 0), gen_length)
    blocks = gen_length // block
    per_block = max(1, round(gen_length * d.steps / d.gen_length / blocks))
    return block, min(block, per_block) * blocks


def parse_request(body: Any, defaults: SamplingParams, chat: bool) -> GatewayRequest:
    """Read a request body; raise InvalidRequest naming every bad OpenAI parameter."""
    if not isinstance(body, dict):
        raise InvalidRequest([FieldViolation("body", "must be a JSON object")])
    v: list[FieldViolation] = []
    x = _typed(body, v)
    _unsupported(body, v)
    messages = _messages(body, v) if chat else None
    prompt = "" if chat else _prompt(body, v)
    length_param = "max_completion_tokens" if chat and "max_completion_tokens" in x else "max_tokens"
    gen, block, steps = x.get(length_param), x.get("block_length"), x.get("steps")
    if gen is not None and gen >= 1:  # even when too large, so only max_tokens is reported
        fits = block is not None and 1 <= block <= gen and gen % block == 0
        fitted_block, fitted_steps = fit_schedule(gen, defaults, block if fits else None)
        block = fitted_block if block is None else block
        steps = fitted_steps if steps is None else steps
    if body.get("diffusing") and not body.get("stream"):
        v.append(FieldViolation("diffusing", "needs stream: true"))
    if v:
        raise InvalidRequest(v)
    params = replace(
        defaults, gen_length=defaults.gen_length if gen is None else gen,
        steps=defaults.steps if steps is None else steps,
        block_length=defaults.block_length if block is None else block,
        temperature=x.get("temperature", defaults.temperature),
        remasking=body.get("remasking", defaults.remasking), threshold=x.get("threshold", defaults.threshold),
        factor=x.get("factor", defaults.factor), cfg_scale=x.get("cfg_scale", defaults.cfg_scale),
        seed=x.get("seed", defaults.seed))
    return GatewayRequest(chat, prompt, messages, params, bool(body.get("stream")), bool(body.get("diffusing")),
                          length_param)


def rename_fields(e: InvalidRequest, req: Optional[GatewayRequest]) -> InvalidRequest:
    """Engine field names -> the OpenAI parameter the client actually sent."""
    names = {"gen_length": req.length_param if req else "max_tokens", "token_ids": "prompt"}
    return InvalidRequest([FieldViolation(names.get(f.field, f.field), f.description) for f in e.violations])


def error_body(message: str, type_: str, param: Optional[str] = None, code: Optional[str] = None,
               **extra: Any) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code, **extra}}


def error_response(exc: BaseException) -> tuple[int, dict, dict[str, str]]:
    """(HTTP status, OpenAI error body, extra headers) for an engine error; 500 for anything else."""
    if isinstance(exc, InvalidRequest):
        first = exc.violations[0].field if exc.violations else None
        fields = [{"field": f.field, "description": f.description} for f in exc.violations]
        return 400, error_body(str(exc), "invalid_request_error", first, "invalid_value", field_violations=fields), {}
    if isinstance(exc, Overloaded):
        retry = max(1, math.ceil(exc.retry_after_s))
        return 429, error_body(str(exc), "rate_limit_error", None, "rate_limit_exceeded"), {"Retry-After": str(retry)}
    if isinstance(exc, (Unavailable, ModelLoadError)):
        return 503, error_body(str(exc), "service_unavailable", None, "unavailable"), {"Retry-After": "1"}
    kind = "engine error" if isinstance(exc, EngineError) else "internal error"
    return 500, error_body(f"{kind}: {exc}", "server_error", None, "internal_error"), {}
