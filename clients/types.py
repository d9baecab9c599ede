"""Plain records the client hands out, converted from the protobuf messages.

Callers never see protobufs: a `Snapshot` is one GenerateResponse (a full canvas, replace not
append), a `Result` is the last one, and `build_request` turns a prompt and keyword knobs into a
GenerateRequest. Only this module and `client.py` touch `celeris.v1` messages.
"""

from __future__ import annotations

import json

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

from celeris.v1 import generation_pb2 as pb

# A prompt is text, already tokenized ids, or a conversation [{"role": ..., "content": ...}] (an
# assistant turn may carry OpenAI-shaped "tool_calls", a "tool" turn its "tool_call_id").
Prompt = Union[str, Sequence[int], Sequence[Mapping[str, Any]]]

REMASKING = {"low_confidence": pb.REMASKING_LOW_CONFIDENCE, "random": pb.REMASKING_RANDOM,
             "margin": pb.REMASKING_MARGIN, "entropy": pb.REMASKING_ENTROPY}
REMASKING_NAMES = {v: k for k, v in REMASKING.items()}
FORMATS = {"full": pb.SNAPSHOT_FORMAT_FULL, "delta": pb.SNAPSHOT_FORMAT_DELTA}
STREAM_MODES = {"every_step": pb.STREAM_MODE_UNSPECIFIED, "every_k_steps": pb.STREAM_MODE_EVERY_K_STEPS,
                "block_complete": pb.STREAM_MODE_BLOCK_COMPLETE, "final_only": pb.STREAM_MODE_FINAL_ONLY}
FINISH_REASONS = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_STOP: "stop",
                  pb.FINISH_REASON_CANCELLED: "cancelled", pb.FINISH_REASON_TOOL_CALLS: "tool_calls"}
TOOL_CHOICES = {"none": pb.TOOL_CHOICE_MODE_NONE, "auto": pb.TOOL_CHOICE_MODE_AUTO,
                "required": pb.TOOL_CHOICE_MODE_REQUIRED}
KV_CACHES = {"none": pb.KV_CACHE_NONE, "prefix": pb.KV_CACHE_PREFIX, "dual": pb.KV_CACHE_DUAL}
KV_CACHE_NAMES = {pb.KV_CACHE_NONE: "none", pb.KV_CACHE_PREFIX: "prefix", pb.KV_CACHE_DUAL: "dual",
                  pb.KV_CACHE_EXACT: "exact"}
FACTOR_RULES = {"fast_dllm": pb.FACTOR_RULE_FAST_DLLM, "paper": pb.FACTOR_RULE_PAPER}
SCHEDULES = {"llada": pb.SCHEDULE_LLADA, "dream": pb.SCHEDULE_DREAM}
DECODING_MODES = {"ar": pb.DECODING_MODE_AR, "diffusion": pb.DECODING_MODE_DIFFUSION,
                  "linear_spec": pb.DECODING_MODE_LINEAR_SPEC}
# Knobs that map one to one onto optional GenerateRequest fields, and the enum ones by name.
SCALAR_KNOBS = ("gen_length", "steps", "block_length", "temperature", "threshold", "factor", "cfg_scale", "seed",
                "eps", "top_k", "top_p", "min_p", "ignore_eos", "min_tokens", "logprobs", "n", "frequency_penalty",
                "presence_penalty", "max_denoising_steps", "entropy_bound", "t_min", "t_max", "stability_threshold",
                "confidence_threshold", "editing_threshold", "max_post_steps")
ENUM_KNOBS = {"remasking": REMASKING, "kv_cache": KV_CACHES, "factor_rule": FACTOR_RULES, "schedule": SCHEDULES,
              "decoding": DECODING_MODES}
KNOBS = (*SCALAR_KNOBS, *ENUM_KNOBS, "stop_token_ids", "stop")


@dataclass(frozen=True)
class Token:
    id: int
    text: str
    masked: bool
    committed_this_step: bool
    confidence: float  # meaningful only when committed_this_step
    logprob: Optional[float] = None  # with logprobs=N: at the step it was committed (last snapshot)
    top_logprobs: tuple[tuple[int, str, float], ...] = ()  # (id, text, logprob), most likely first
    # The stream contract: True once this position's id will never change again (committed, for a
    # mask model; inside a stopped canvas, for a revising model such as DiffusionGemma). False while
    # masked, and while a revising model may still replace the token shown.
    final: bool = False


@dataclass(frozen=True)
class ToolCall:
    """One call of a tool in an answer (Result.tool_calls)."""

    id: str
    name: str
    arguments: str  # JSON text of an object (always valid against the schema when tool_choice enforced it)

    @property
    def args(self) -> Any:
        """The arguments, parsed (json.loads)."""
        return json.loads(self.arguments)

    def openai(self) -> dict[str, Any]:
        """OpenAI's shape, as an assistant message's "tool_calls" item sent back in the next turn."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    generated_tokens: int  # before the first EOS: the numerator of output tokens/s
    forward_passes: int


@dataclass(frozen=True)
class Snapshot:
    """One streamed state of the canvas. `step` is 1-based; the last snapshot has done=True."""

    request_id: str
    step: int
    total_steps: int
    block_index: int
    num_blocks: int
    text: str  # masked positions shown as the model's mask marker
    tokens: tuple[Token, ...]
    committed_positions: tuple[int, ...]  # since the previous snapshot sent
    committed_confidences: tuple[float, ...]
    done: bool
    finish_reason: Optional[str] = None  # "length" | "stop" | "cancelled", last snapshot only
    usage: Optional[Usage] = None
    seed: Optional[int] = None
    elapsed_s: Optional[float] = None
    kv_cache: Optional[str] = None  # what the request decoded over, last snapshot only
    choice: int = 0  # which sample (n > 1)
    # With provisional=True (delta streams): (position, the token the sampler ranks first there,
    # its confidence in Token.confidence) for the still-masked positions of the block being
    # decoded, as of this snapshot's step. The positions stay masked in `tokens`.
    provisional: tuple[tuple[int, Token], ...] = ()
    final_positions: int = 0  # positions [0, final_positions) are final in every family
    # Positions whose token, shown unmasked before, this snapshot replaces with another (a revising
    # model's canvas being denoised; never for a mask model).
    revised: tuple[int, ...] = ()
    revising: bool = False  # the model may replace unmasked tokens that are not final (DiffusionGemma)
    # Last snapshot of a chat answer the server read with its parsers (tools, reasoning): the calls
    # it made, its thinking-channel text, and its text without either (None: not read / none).
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: Optional[str] = None
    content: Optional[str] = None
    # Last snapshot of a choice asked with logprobs (typed decisions): {option: probability}, in
    # the options' order, summing to 1 (docs/structured-outputs.md); None otherwise.
    choice_probabilities: Optional[dict[str, float]] = None

    @property
    def masked_count(self) -> int:
        return sum(t.masked for t in self.tokens)

    @classmethod
    def from_pb(cls, m: pb.GenerateResponse) -> Snapshot:
        usage = None
        if m.HasField("usage"):
            usage = Usage(m.usage.prompt_tokens, m.usage.generated_tokens, m.usage.forward_passes)
        return cls(
            request_id=m.request_id, step=m.step, total_steps=m.total_steps, block_index=m.block_index,
            num_blocks=m.num_blocks, text=m.text,
            tokens=tuple(Token(t.id, t.text, t.masked, t.committed_this_step, t.confidence,
                               t.logprob if t.HasField("logprob") else None,
                               tuple((a.id, a.text, a.logprob) for a in t.top_logprobs), t.final)
                    for t in m.tokens),
            committed_positions=tuple(m.committed_positions),
            committed_confidences=tuple(m.committed_confidences), done=m.done,
            finish_reason=FINISH_REASONS.get(m.finish_reason), usage=usage, seed=m.seed if m.done else None,
            elapsed_s=m.elapsed.ToNanoseconds() / 1e9 if m.HasField("elapsed") else None,
            kv_cache=KV_CACHE_NAMES.get(m.kv_cache) if m.done else None, choice=m.choice,
            final_positions=m.final_positions, revising=m.revising,
            tool_calls=tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls),
            reasoning=m.reasoning if m.HasField("reasoning") else None,
            content=m.content if m.HasField("content") else None,
            choice_probabilities={c.option: c.probability for c in m.choice_probabilities} or None)


@dataclass(frozen=True)
class Result:
    """The outcome of one generation (the stream's last message)."""

    request_id: str
    text: str  # the generated text, cut before the first EOS (the model's raw answer, call markup included)
    finish_reason: str  # "length" | "stop" | "cancelled" | "tool_calls"
    usage: Usage
    seed: int
    steps: int  # denoising steps actually used
    elapsed_s: float
    tokens: tuple[Token, ...]
    kv_cache: str = "none"  # none, prefix, dual (approximate) or exact (block models)
    # Chat answers the server read (tools=..., or a reasoning parser on the server): the tool calls,
    # the thinking-channel text, and the text without either (None when not read, or only calls).
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: Optional[str] = None
    content: Optional[str] = None
    # A choice asked with logprobs (typed decisions): {option: probability}; None otherwise.
    choice_probabilities: Optional[dict[str, float]] = None

    @classmethod
    def from_snapshot(cls, s: Snapshot) -> Result:
        return cls(s.request_id, s.text, s.finish_reason or "length", s.usage or Usage(0, 0, 0), s.seed or 0,
                   s.step, s.elapsed_s or 0.0, s.tokens, s.kv_cache or "none", s.tool_calls, s.reasoning, s.content,
                   s.choice_probabilities)

    def message(self) -> dict[str, Any]:
        """This answer as the assistant turn of the next request's conversation (OpenAI's shape):
        its content (the read content when the server read it) and its tool_calls."""
        read = self.tool_calls or self.reasoning is not None or self.content is not None
        msg: dict[str, Any] = {"role": "assistant", "content": (self.content or "") if read else self.text}
        if self.tool_calls:
            msg["tool_calls"] = [c.openai() for c in self.tool_calls]
        return msg


@dataclass(frozen=True)
class Limits:
    max_prompt_tokens: int
    max_gen_length: int
    max_batch: int
    max_queue: int


@dataclass(frozen=True)
class Defaults:
    gen_length: int
    steps: int
    block_length: int
    temperature: float
    remasking: str
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # Revising models' knobs (DiffusionGemma); a mask model reports the values it requires.
    max_denoising_steps: int = 0
    entropy_bound: float = 0.0
    t_min: float = 0.0
    t_max: float = 0.0
    stability_threshold: int = 0
    confidence_threshold: float = 0.0


@dataclass(frozen=True)
class ModelInfo:
    name: str
    architecture: str
    parameter_count: int
    vocab_size: int
    mask_token_id: int
    eos_token_id: int
    limits: Limits
    defaults: Defaults
    dtype: str
    device: str
    family: str = ""  # "full" (LLaDA, Dream), "block" (SDAR, LLaDA2.x) or "revise" (DiffusionGemma)
    token_editing: bool = False  # LLaDA2.1: written tokens of the current block may be replaced

    @classmethod
    def from_pb(cls, m: pb.GetModelInfoResponse) -> ModelInfo:
        lim, d = m.limits, m.defaults
        return cls(m.name, m.architecture, m.parameter_count, m.vocab_size, m.mask_token_id, m.eos_token_id,
                   Limits(lim.max_prompt_tokens, lim.max_gen_length, lim.max_batch, lim.max_queue),
                   Defaults(d.gen_length, d.steps, d.block_length, d.temperature,
                            REMASKING_NAMES.get(d.remasking, "unspecified"), d.frequency_penalty, d.presence_penalty,
                            d.max_denoising_steps, d.entropy_bound, d.t_min, d.t_max, d.stability_threshold,
                            d.confidence_threshold),
                   m.dtype, m.device, m.family, m.token_editing)


@dataclass(frozen=True)
class Tokenization:
    ids: tuple[int, ...]
    tokens: tuple[str, ...]


def _set_input(req: pb.GenerateRequest, prompt: Prompt) -> None:
    if isinstance(prompt, str):
        req.prompt = prompt
    elif prompt and all(isinstance(m, Mapping) for m in prompt):
        req.chat.messages.extend(_chat_message(m) for m in prompt)
    elif all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        req.token_ids.ids.extend(prompt)  # an empty list is sent as is; the server names the field
    else:
        raise TypeError("prompt must be a str, a sequence of token ids, or a list of {role, content} messages")


def _chat_message(m: Mapping[str, Any]) -> pb.ChatMessage:
    """One turn: role and content (None: empty), an assistant's tool_calls (OpenAI's shape, or
    ToolCall records), a tool result's tool_call_id and name."""
    msg = pb.ChatMessage(role=m["role"], content=m.get("content") or "", tool_call_id=m.get("tool_call_id") or "",
                         name=m.get("name") or "")
    for c in m.get("tool_calls") or ():
        if isinstance(c, ToolCall):
            c = c.openai()
        fn = c.get("function", c)  # OpenAI's {"function": {...}}, or the function fields themselves
        args = fn.get("arguments", "{}")
        msg.tool_calls.add(id=c.get("id", ""), name=fn["name"],
                           arguments=args if isinstance(args, str) else json.dumps(args))
    return msg


def _set_tools(req: pb.GenerateRequest, tools: Sequence[Mapping[str, Any]]) -> None:
    """OpenAI's tools list ([{"type": "function", "function": {"name", "description", "parameters",
    "strict"}}], or the function dicts themselves); parameters as a dict or JSON text."""
    for t in tools:
        fn = t.get("function", t)
        params = fn.get("parameters")
        req.tools.add(name=fn.get("name", ""), description=fn.get("description") or "",
                      parameters="" if params is None else params if isinstance(params, str) else json.dumps(params),
                      strict=bool(fn.get("strict", False)))


def _set_tool_choice(req: pb.GenerateRequest, choice: Union[str, Mapping[str, Any]]) -> None:
    """"none" | "auto" | "required", or a named function: {"type": "function", "function":
    {"name": ...}} (OpenAI's) or {"name": ...}."""
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise ValueError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or {{\"name\": ...}}, "
                             f"got {choice!r}")
        req.tool_choice.mode = TOOL_CHOICES[choice]
        return
    name = choice.get("function", choice).get("name") if isinstance(choice, Mapping) else None
    if not isinstance(name, str):
        raise ValueError(f"tool_choice must name a function ({{\"type\": \"function\", \"function\": "
                         f"{{\"name\": ...}}}}), got {choice!r}")
    req.tool_choice.mode, req.tool_choice.name = pb.TOOL_CHOICE_MODE_FUNCTION, name


def build_request(prompt: Prompt, *, request_id: str = "", stream_mode: str = "every_step",
                  every_k_steps: int = 0, stream_format: str = "", provisional: bool = False,
                  structured_output: Optional[dict] = None, tools: Optional[Sequence[Mapping[str, Any]]] = None,
                  tool_choice: Union[str, Mapping[str, Any], None] = None, parallel_tool_calls: Optional[bool] = None,
                  **knobs: Any) -> pb.GenerateRequest:
    """A GenerateRequest; knobs left out or None take the server's defaults. `stream_format`:
    "full" or "delta" (SnapshotFormat); empty leaves it unset (full). `provisional` (delta
    only): snapshots also carry the current block's top predictions (Snapshot.provisional).
    `structured_output`: one of {"json_schema": schema (dict or JSON text)}, {"regex": str},
    {"choice": [str, ...]}, {"json_object": True}: the text always matches it.
    `tools` (OpenAI's list), `tool_choice` ("none", "auto", "required" or {"type": "function",
    "function": {"name": ...}}) and `parallel_tool_calls`: chat prompts only (docs/tools.md); the
    result's tool_calls, reasoning and content carry what the server read from the answer."""
    unknown = set(knobs) - set(KNOBS)
    if unknown:
        raise TypeError(f"unknown generation knob(s): {', '.join(sorted(unknown))}; known: {', '.join(KNOBS)}")
    if stream_mode not in STREAM_MODES:
        raise ValueError(f"stream_mode must be one of {', '.join(STREAM_MODES)}, got {stream_mode!r}")
    req = pb.GenerateRequest(request_id=request_id)
    _set_input(req, prompt)
    for name in SCALAR_KNOBS:
        if knobs.get(name) is not None:
            setattr(req, name, knobs[name])
    if knobs.get("stop_token_ids"):
        req.stop_token_ids.extend(knobs["stop_token_ids"])
    if knobs.get("stop"):  # one string or a list of them, as OpenAI's `stop`
        req.stop.extend([knobs["stop"]] if isinstance(knobs["stop"], str) else knobs["stop"])
    for name, table in ENUM_KNOBS.items():
        value = knobs.get(name)
        if value is not None:
            if value not in table:
                raise ValueError(f"{name} must be one of {', '.join(table)}, got {value!r}")
            setattr(req, name, table[value])
    if stream_format and stream_format not in FORMATS:
        raise ValueError(f"stream_format must be one of {', '.join(FORMATS)}, got {stream_format!r}")
    req.stream_options.format = FORMATS.get(stream_format, pb.SNAPSHOT_FORMAT_UNSPECIFIED)
    req.stream_options.mode = STREAM_MODES[stream_mode]
    req.stream_options.every_k_steps = every_k_steps
    req.stream_options.provisional = bool(provisional)
    if structured_output is not None:
        _set_structured(req.structured_output, structured_output)
    if tools:
        _set_tools(req, tools)
    if tool_choice is not None:
        _set_tool_choice(req, tool_choice)
    if parallel_tool_calls is not None:
        req.parallel_tool_calls = bool(parallel_tool_calls)
    return req


def _set_structured(so: pb.StructuredOutput, spec: dict) -> None:
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in STRUCTURED_KINDS:
        raise ValueError(f"structured_output must be one of {{kind: value}} with kind in {', '.join(STRUCTURED_KINDS)}")
    kind, value = next(iter(spec.items()))
    if kind == "json_schema":
        so.json_schema = value if isinstance(value, str) else json.dumps(value)
    elif kind == "choice":
        so.choice.values.extend(value)
    elif kind == "regex":
        so.regex = value
    else:
        so.json_object = bool(value)


STRUCTURED_KINDS = ("json_schema", "regex", "choice", "json_object")
