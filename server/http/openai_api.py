"""The only OpenAI JSON <-> engine mapping, for the HTTP gateway (as convert.py is for protobuf).

Requests: `parse_request` reads a /v1/completions or /v1/chat/completions body into an engine
prompt plus SamplingParams. `max_tokens` is the canvas length (gen_length); when it is given
without the diffusion fields, block_length and steps are fitted to it so that a plain OpenAI
client never trips over "gen_length must be a multiple of block_length". Extension fields:
steps, block_length, threshold, factor, factor_rule, schedule, eps, kv_cache, cfg_scale,
remasking, and `diffusing` (stream snapshots: true or "delta" sends only the changed positions,
"full" the whole canvas every step); `top_k`, `top_p`, `min_p`, `stop_token_ids`, `min_tokens`,
`ignore_eos` as in vLLM; `stop`, `logprobs` / `top_logprobs`, `frequency_penalty` and
`presence_penalty` as OpenAI. OpenAI parameters this server cannot honour (repetition_penalty,
logit_bias, best_of, suffix) and unknown keys are a 400 naming the field
unless they carry their neutral value. `response_format` (json_object, json_schema) and vLLM's
`structured_outputs` (json, regex, choice) are read by server/structured_api.py; `tools`,
`tool_choice`, `parallel_tool_calls` and the tool messages of a chat history by server/tools_api.py.

Only the mapping lives here: JSON types and OpenAI names. Every value is validated once, by the
engine's request builder (`LLM.build`), as for gRPC; errors go through the one table in
server/errors.py (`error_response` is its HTTP side).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from celeris.engine.errors import FieldViolation, InvalidRequest, clip
from celeris.engine.requests import (BOOL, CHOICE, FLOAT, INT, MAX_SEED, Request, SamplingParams, Structured,
                                     fit_lengths, on)
from celeris.server.errors import ModelNotFound, error_body, to_openai
from celeris.server.structured_api import FIELDS as STRUCTURED_FIELDS, from_body as structured_from_body
from celeris.server import tools_api
from celeris.server.tools_api import ToolRequest

# Knob body fields by kind, from the knob table (engine/sampling/knobs.py), plus the OpenAI fields that
# are not knobs. Enum knobs travel as strings and are checked by the engine.
INTS = (*(k.http for k in on("http", INT)), "max_completion_tokens", "n", "best_of", "top_logprobs")
FLOATS = tuple(k.http for k in on("http", FLOAT))
STRINGS = tuple(k.http for k in on("http", CHOICE))
BOOLS = tuple(k.http for k in on("http", BOOL))
# OpenAI parameters whose non-default values we cannot honour: rejected, never silently ignored.
# Each maps to the values that ask for nothing (what a client sends when it leaves the knob alone).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (1,), "suffix": ("",), "repetition_penalty": (1,), "logit_bias": ({},),
}
# Known fields that change nothing here (metadata).
# stream_options: include_usage adds OpenAI's usage-only last chunk (usage also rides the last choice chunk).
ACCEPTED = ("model", "user", "stream_options", "metadata", "store")
TOOL_FIELDS = (*tools_api.CHAT_ONLY, *tools_api.DEPRECATED)  # read by server/tools_api.py
OPENAI_KNOBS = ("max_tokens", "temperature", "top_p", "frequency_penalty", "presence_penalty", "seed", "stop")
EXTENSIONS = (*(k.http for k in on("http") if k.http not in OPENAI_KNOBS), "diffusing", "cache_salt")
COMMON = (*OPENAI_KNOBS, "stream", "n", "echo", "logprobs", "top_logprobs", *ACCEPTED, *EXTENSIONS, *UNSUPPORTED,
          *STRUCTURED_FIELDS, *TOOL_FIELDS)
FIELDS = {False: frozenset(("prompt", *COMMON)), True: frozenset(("messages", "max_completion_tokens", *COMMON))}
SEED_TEXT = re.compile(r"-?[0-9]{1,20}")
DIFFUSING_FORMATS = ("delta", "full")  # `diffusing` as a string: the stream format; true is "delta"
MAX_CHOICES = 16  # prompts x n in one HTTP request: each is its own engine request


@dataclass(frozen=True)
class GatewayRequest:
    chat: bool
    prompts: list[Union[str, list[int]]]  # completions: one or several; ignored for chat
    messages: Optional[list[dict]]
    params: SamplingParams
    stream: bool
    diffusing: bool
    length_param: str  # the name the client used for the length (for error messages)
    n: int = 1  # samples of each prompt, batched in the same steps with seeds seed, seed+1, ...
    echo: bool = False  # completions: the prompt's text before each choice's text
    model: str = ""  # the served name the client asked for (echoed in responses), else the first
    diffusing_format: str = "delta"  # with diffusing: "delta" (changed positions) or "full" (whole canvas)
    include_usage: bool = False  # stream_options.include_usage: a last chunk with empty choices and the usage
    structured: Optional[Structured] = None  # response_format / structured_outputs (server/structured_api.py)
    cache_salt: Optional[str] = None  # vLLM's: the prefix cache's tenant (docs/prefix-cache.md)
    tools: Optional[ToolRequest] = None  # chat tools, tool_choice, parallel_tool_calls (server/tools_api.py)
    fit_canvas: bool = False  # no max_tokens, steps or block_length: a structure may size the canvas

    @property
    def prompt(self) -> Union[str, list[int]]:
        return self.prompts[0] if self.prompts else ""


def _typed(body: dict, v: list[FieldViolation]) -> dict[str, Any]:
    """Type-check the numeric and boolean fields; return those present and well typed."""
    out: dict[str, Any] = {}
    for name in INTS + FLOATS:
        x = body.get(name)
        if x is None:
            continue
        if name == "seed" and isinstance(x, str) and SEED_TEXT.fullmatch(x):
            x = int(x)  # seeds travel as strings too: JavaScript numbers lose digits past 2^53
        # Bounded before any arithmetic: a 400-digit integer must be a 400, not an OverflowError.
        if name in INTS:
            ok = isinstance(x, int) and -MAX_SEED - 1 <= x <= MAX_SEED
        else:
            ok = isinstance(x, (int, float)) and abs(x) <= 1e300 and math.isfinite(x)
        if isinstance(x, bool) or not ok:
            what = "an integer in [-2^63, 2^63)" if name in INTS else "a finite number"
            what += " (or a string of its digits)" if name == "seed" else ""
            v.append(FieldViolation(name, f"must be {what}, got {clip(x)}"))
        else:
            out[name] = x
    stop = body.get("stop")
    if isinstance(stop, str):
        out["stop"] = (stop,)
    elif isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        if stop:
            out["stop"] = tuple(stop)
    elif stop is not None:
        v.append(FieldViolation("stop", f"must be a string or a list of strings, got {clip(stop)}"))
    ids = body.get("stop_token_ids")
    if isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**31 for i in ids):
        if ids:
            out["stop_token_ids"] = tuple(ids)
    elif ids is not None:
        v.append(FieldViolation("stop_token_ids", f"must be a list of token ids, got {clip(ids)}"))
    for name in ("stream", "diffusing", *BOOLS):
        if name == "diffusing" and body.get(name) in DIFFUSING_FORMATS:
            continue
        if not isinstance(body.get(name, False), bool):
            v.append(FieldViolation(name, f"must be a boolean, got {clip(body[name])}"))
        elif name in BOOLS and name in body:
            out[name] = body[name]
    for name in STRINGS:
        if name in body and not isinstance(body[name], str):
            v.append(FieldViolation(name, f"must be a string, got {clip(body[name])}"))
        elif name in body:
            out[name] = body[name]
    return out


def _same(x: Any, neutral: Any) -> bool:
    """x is the neutral value: 0.0 is 0, but False is not 0 and "1" is not 1."""
    if isinstance(neutral, bool) or isinstance(x, bool):
        return x is neutral
    if isinstance(neutral, (int, float)):
        return isinstance(x, (int, float)) and x == neutral
    return type(x) is type(neutral) and x == neutral


def _unsupported(body: dict, chat: bool, v: list[FieldViolation]) -> None:
    """Unknown fields and OpenAI parameters asking for what this server cannot do, each named."""
    v += _unknown(body, FIELDS[chat])
    for name, neutral in UNSUPPORTED.items():
        x = body.get(name)
        if x is not None and not any(_same(x, n) for n in neutral):
            shown = " or ".join(json.dumps(n) for n in neutral)
            v.append(FieldViolation(name, f"is not supported by this server (only {shown}, or leave it out)"))


TOKENIZE_FIELDS = ("model", "prompt", "messages", "return_token_strs", "add_special_tokens", "add_generation_prompt")


def _unknown(body: dict, known: Sequence[str]) -> list[FieldViolation]:
    return [FieldViolation(clip(k, 64) if not isinstance(k, str) or len(k) > 64 else k,
                           "is not a field this server knows; unsupported fields are refused, never ignored")
            for k in body if k not in known]


def _ids(p: Any) -> bool:
    return isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)


def _prompts(body: dict, v: list[FieldViolation]) -> list[Union[str, list[int]]]:
    """OpenAI's prompt: a string, token ids, or a list of either (several prompts)."""
    p = body.get("prompt")
    if isinstance(p, str) or (_ids(p) and p):
        return [p]
    if isinstance(p, list) and p and all(isinstance(x, str) or (_ids(x) and x) for x in p):
        if len(p) <= MAX_CHOICES:
            return list(p)
        v.append(FieldViolation("prompt", f"at most {MAX_CHOICES} prompts per request, got {len(p)}"))
        return []
    v.append(FieldViolation("prompt", "must be a string, a list of token ids, or a list of those"))
    return []


def _content(content: Any) -> Any:
    """A string, or OpenAI content parts joined (text parts only); anything else is left for the
    engine to refuse."""
    if not isinstance(content, list):
        return content
    if not all(isinstance(p, dict) and isinstance(p.get("type"), str) for p in content):
        return content
    texts = [p.get("text") for p in content if p["type"] == "text"]
    return "".join(texts) if all(isinstance(t, str) for t in texts) else content


def _messages(body: dict, v: list[FieldViolation]) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        v.append(FieldViolation("messages", "must be a non-empty list of {role, content} objects"))
        return []
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            out.append({"role": None, "content": None})
            continue
        content = m.get("content")  # null beside an assistant's tool_calls
        role = "system" if m.get("role") == "developer" else m.get("role")  # OpenAI's newer name for it
        out.append(tools_api.message(i, m, "" if content is None else _content(content), role, v))
    return tools_api.name_results(out)


def engine_requests(req: GatewayRequest, request_id: str) -> list[Request]:
    """One engine request per choice, prompt-major (choice index = prompt index * n + sample):
    samples of a prompt get seeds seed, seed+1, ... (the engine picks and reports them when
    unset); ids get a -k suffix when a client id covers several choices."""
    numbered, out = len(req.prompts) * req.n > 1, []
    for i, prompt in enumerate(req.prompts):
        if req.chat:
            tools = req.tools.template_tools() if req.tools is not None else None
            one = Request(messages=req.messages, params=req.params, request_id=request_id,
                          structured=req.structured, cache_salt=req.cache_salt, fit_canvas=req.fit_canvas,
                          **({"tools": tools} if tools else {}))
        elif isinstance(prompt, str):
            one = Request(prompt=prompt, params=req.params, request_id=request_id,
                          structured=req.structured, cache_salt=req.cache_salt, fit_canvas=req.fit_canvas)
        else:
            one = Request(token_ids=prompt, params=req.params, request_id=request_id,
                          structured=req.structured, cache_salt=req.cache_salt, fit_canvas=req.fit_canvas)
        out += one.samples(req.n, first=i * req.n, numbered=numbered)
    return out


def _logprobs(body: dict, chat: bool, x: dict, v: list[FieldViolation]) -> Optional[int]:
    """OpenAI's two spellings: completions `logprobs: N` (alternatives), chat `logprobs: true`
    with `top_logprobs: N`. None: not asked."""
    lp = body.get("logprobs")
    if chat:
        if lp is not None and not isinstance(lp, bool):
            v.append(FieldViolation("logprobs", f"must be a boolean, got {clip(lp)}"))
            return None
        if "top_logprobs" in x and not lp:
            v.append(FieldViolation("top_logprobs", "needs logprobs: true"))
        return x.get("top_logprobs", 0) if lp else None
    if lp is None or lp is False:
        return None
    if isinstance(lp, bool) or not isinstance(lp, int):
        v.append(FieldViolation("logprobs", f"must be an integer (alternatives per token), got {clip(lp)}"))
        return None
    return lp


def model_not_found(name: str, served: Sequence[str]) -> ModelNotFound:
    shown = name if len(name) <= 100 else name[:100] + "..."
    return ModelNotFound([FieldViolation("model", f"the model `{shown}` does not exist; this server serves "
                                                  f"{', '.join(repr(n) for n in served)}")])


def _model(body: dict, served: Sequence[str]) -> str:
    """The served name asked for; a missing (or null) `model` means the first. Checked before
    anything else, as vLLM and OpenAI do: a wrong model is 404 model_not_found."""
    name = body.get("model")
    if name is None:
        return served[0]
    if not isinstance(name, str):
        raise InvalidRequest([FieldViolation("model", f"must be a string, got {clip(name)}")])
    if name not in served:
        raise model_not_found(name, served)
    return name


def parse_request(body: Any, defaults: SamplingParams, chat: bool, models: Sequence[str] = ()) -> GatewayRequest:
    """Read a request body; raise InvalidRequest naming every bad OpenAI parameter. `models`: the
    served names (empty: no check, the model is reported as given)."""
    if not isinstance(body, dict):
        raise InvalidRequest([FieldViolation("body", "must be a JSON object")])
    model = _model(body, models) if models else str(body.get("model") or "")
    v: list[FieldViolation] = []
    x = _typed(body, v)
    _unsupported(body, chat, v)
    messages = _messages(body, v) if chat else None
    prompts = [""] if chat else _prompts(body, v)
    structured = structured_from_body(body, v)
    tools = tools_api.from_body(body, chat, v)
    tools_api.check_structured(tools, structured, body, v)
    n = x.get("n", 1)
    if not 1 <= n <= MAX_CHOICES or len(prompts) * n > MAX_CHOICES:
        v.append(FieldViolation("n", f"prompts x n must be in [1, {MAX_CHOICES}], got {len(prompts)} x {n}"))
    echo = body.get("echo", False)
    if chat and "echo" in body:
        v.append(FieldViolation("echo", "is a completions field"))
    elif not isinstance(echo, bool):
        v.append(FieldViolation("echo", f"must be a boolean, got {clip(echo)}"))
    elif echo and body.get("logprobs") not in (None, False):
        v.append(FieldViolation("echo", "with logprobs is not supported (prompt tokens have none here)"))
    length_param = "max_completion_tokens" if chat and "max_completion_tokens" in x else "max_tokens"
    if body.get("diffusing") and not body.get("stream"):
        v.append(FieldViolation("diffusing", "needs stream: true"))
    if body.get("cache_salt") is not None and not isinstance(body.get("cache_salt"), str):
        v.append(FieldViolation("cache_salt", f"must be a string, got {clip(body.get('cache_salt'))}"))
    if body.get("provisional") is True and body.get("diffusing") not in (True, "delta"):
        v.append(FieldViolation("provisional", 'needs diffusing: true (or "delta"): the predictions ride on delta events'))
    if v:
        raise InvalidRequest(v)
    given = {k.name: x[k.http] for k in on("http") if k.name != "gen_length" and k.http in x}
    logprobs = _logprobs(body, chat, x, v)
    if v:
        raise InvalidRequest(v)
    if logprobs is not None:
        given["logprobs"] = logprobs
    if length_param in x:
        given["gen_length"] = x[length_param]
    if given.get("top_k") == -1:  # vLLM's spelling of "off"
        given["top_k"] = 0
    params = fit_lengths(defaults, given)  # max_tokens alone: steps and block fitted to it
    diffusing = body.get("diffusing")
    return GatewayRequest(chat, prompts, messages, params, bool(body.get("stream")), bool(diffusing),
                          length_param, n, bool(echo), model, diffusing if diffusing in DIFFUSING_FORMATS else "delta",
                          _include_usage(body), structured, body.get("cache_salt"), tools,
                          fit_canvas=not any(k in x for k in (length_param, "steps", "block_length")))


def _include_usage(body: dict) -> bool:
    """OpenAI's `stream_options: {"include_usage": true}`; accepted and moot without `stream: true`."""
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), (bool, type(None))):
        raise InvalidRequest([FieldViolation("stream_options", 'must be an object like {"include_usage": true}')])
    return bool(opts.get("include_usage")) and bool(body.get("stream"))  # without a stream: usage is in the body


@dataclass(frozen=True)
class TokenizeRequest:
    """vLLM's /tokenize body: {"prompt": ...} or chat {"messages": [...]}."""

    prompt: Optional[Union[str, list[int]]]
    messages: Optional[list[dict]]
    return_token_strs: bool
    add_special_tokens: bool = True  # a text prompt's BOS (vLLM's default True; chat: the template's own)


def parse_tokenize(body: Any, models: Sequence[str] = ()) -> TokenizeRequest:
    if not isinstance(body, dict):
        raise InvalidRequest([FieldViolation("body", "must be a JSON object")])
    if models:
        _model(body, models)
    v: list[FieldViolation] = []
    chat = "messages" in body
    if chat == ("prompt" in body):
        v.append(FieldViolation("prompt", "set one of prompt or messages"))
    strs = body.get("return_token_strs", False)
    if not isinstance(strs, (bool, type(None))):
        v.append(FieldViolation("return_token_strs", f"must be a boolean, got {clip(strs)}"))
    # A text prompt may drop its BOS (vLLM's add_special_tokens: false); chat keeps what Generate does.
    special = body.get("add_special_tokens", not chat)
    if not isinstance(special, (bool, type(None))):
        v.append(FieldViolation("add_special_tokens", f"must be a boolean, got {clip(special)}"))
    fixed = (("add_special_tokens", False), ("add_generation_prompt", True)) if chat else (("add_generation_prompt", True),)
    for name, default in fixed:
        if body.get(name, default) not in (default, None):
            v.append(FieldViolation(name, f"is not supported by this server (only {default!r})"))
    v += _unknown(body, TOKENIZE_FIELDS)
    messages = _messages(body, v) if chat else None
    prompts = [] if chat else _prompts(body, v)
    if len(prompts) > 1:
        v.append(FieldViolation("prompt", "one prompt per request here (a string or a list of token ids)"))
    prompt = prompts[0] if len(prompts) == 1 else None
    if v:
        raise InvalidRequest(v)
    return TokenizeRequest(prompt, messages, bool(strs), special is not False)


def parse_detokenize(body: Any, models: Sequence[str] = ()) -> list[int]:
    if not isinstance(body, dict):
        raise InvalidRequest([FieldViolation("body", "must be a JSON object")])
    if models:
        _model(body, models)
    v = _unknown(body, ("model", "tokens"))
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        v.append(FieldViolation("tokens", "must be a list of token ids"))
    if v:
        raise InvalidRequest(v)
    return list(ids)


def rename_fields(e: InvalidRequest, req: Optional[GatewayRequest]) -> InvalidRequest:
    """Engine field names -> the OpenAI parameter the client actually sent."""
    names = {"gen_length": req.length_param if req else "max_tokens", "token_ids": "prompt",
             "request_id": "X-Request-Id", "input": "prompt"}
    return type(e)([FieldViolation(names.get(f.field, f.field), f.description) for f in e.violations])


def error_response(exc: BaseException) -> tuple[int, dict, dict[str, str]]:
    """(HTTP status, OpenAI error body, extra headers): the HTTP side of server/errors.py."""
    return to_openai(exc)


__all__ = ["GatewayRequest", "TokenizeRequest", "parse_request", "parse_tokenize", "parse_detokenize",
           "model_not_found", "engine_requests", "rename_fields", "error_body",
           "error_response"]
