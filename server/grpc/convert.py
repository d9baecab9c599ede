"""The only protobuf <-> engine mapping.

Generate's messages are built by a `ChoiceFormatter` per choice, which the servicer hands to the
scheduler (Scheduler.submit): it runs in the scheduler's formatter thread, once per step event, so the
event loop only writes finished messages. Full snapshots cost O(gen_length) per message; delta
messages (SNAPSHOT_FORMAT_DELTA) cost O(changed positions): each maps one `events.CanvasDelta`,
the record the engine builds for both doors.

Tools (GenerateRequest.tools, tool_choice, parallel_tool_calls and the tool turns of a chat) are
put in OpenAI's shapes and read by the HTTP door's own rules (server/tools_api.py), so both doors
accept, enforce and refuse the same requests; a refusal is named by its proto field path. The
last message's tool_calls, reasoning and content come from the same reader (server/tool_answers.py).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from google.protobuf.duration_pb2 import Duration

from celeris.v1 import generation_pb2 as pb
from celeris.engine.errors import FieldViolation, InvalidRequest
from celeris.engine.events import CanvasDelta, FinishReason, StepEvent
from celeris.engine.requests import (CHOICE, IDS, MAX_SCHEMA_CHARS, MAX_SCHEMA_NESTING, Request, STRINGS,
                                     SamplingParams, fit_lengths, json_text_depth, on)
from celeris.engine.serving import MASK_MARKER, CanvasDeltas, Prepared, Tokenizer
from celeris.server import tool_answers, tools_api
from celeris.server.structured_api import from_fields
from celeris.server.tool_answers import AnswerReader
from celeris.server.tools_api import Parsers, ToolRequest

REMASKING_TO_ENGINE = {
    pb.REMASKING_LOW_CONFIDENCE: "low_confidence",
    pb.REMASKING_RANDOM: "random",
    pb.REMASKING_MARGIN: "margin",
    pb.REMASKING_ENTROPY: "entropy",
}
REMASKING_TO_PB = {v: k for k, v in REMASKING_TO_ENGINE.items()}
KV_CACHE_TO_ENGINE = {pb.KV_CACHE_NONE: "none", pb.KV_CACHE_PREFIX: "prefix", pb.KV_CACHE_DUAL: "dual"}
KV_CACHE_TO_PB = {"none": pb.KV_CACHE_NONE, "prefix": pb.KV_CACHE_PREFIX, "dual": pb.KV_CACHE_DUAL,
                  "exact": pb.KV_CACHE_EXACT}
FACTOR_RULE_TO_ENGINE = {pb.FACTOR_RULE_FAST_DLLM: "fast_dllm", pb.FACTOR_RULE_PAPER: "paper"}
SCHEDULE_TO_ENGINE = {pb.SCHEDULE_LLADA: "llada", pb.SCHEDULE_DREAM: "dream"}
SCHEDULE_TO_PB = {v: k for k, v in SCHEDULE_TO_ENGINE.items()}
DECODING_TO_ENGINE = {pb.DECODING_MODE_AR: "ar", pb.DECODING_MODE_DIFFUSION: "diffusion",
                      pb.DECODING_MODE_LINEAR_SPEC: "linear_spec"}
ENUMS_TO_ENGINE = {"remasking": REMASKING_TO_ENGINE, "kv_cache": KV_CACHE_TO_ENGINE | {pb.KV_CACHE_EXACT: "exact"},
                   "factor_rule": FACTOR_RULE_TO_ENGINE, "schedule": SCHEDULE_TO_ENGINE, "decoding": DECODING_TO_ENGINE}
FINISH_TO_PB = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}
TOOL_CHOICE_TO_OPENAI = {pb.TOOL_CHOICE_MODE_NONE: "none", pb.TOOL_CHOICE_MODE_AUTO: "auto",
                         pb.TOOL_CHOICE_MODE_REQUIRED: "required"}
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")  # chat prompts only


@dataclass(frozen=True)
class StreamPlan:
    """Which snapshots of a request to send."""

    mode: int = pb.STREAM_MODE_UNSPECIFIED
    every_k: int = 1
    delta: bool = False  # SNAPSHOT_FORMAT_DELTA
    provisional: bool = False  # delta messages carry the current block's top predictions

    def wants(self, ev: StepEvent) -> bool:
        if ev.finished:
            return True
        if self.mode == pb.STREAM_MODE_FINAL_ONLY:
            return False
        if self.mode == pb.STREAM_MODE_BLOCK_COMPLETE:
            return ev.block_complete
        if self.mode == pb.STREAM_MODE_EVERY_K_STEPS:
            return (ev.step + 1) % self.every_k == 0
        return True


# Engine field names -> the GenerateRequest field paths a client sees in BadRequest.
PROTO_FIELDS = {"messages": "chat.messages", "token_ids": "token_ids.ids"}
# OpenAI's {"function": {...}} level, which Tool, ToolChoice and ToolCall do not have.
FUNCTION_LEVEL = re.compile(r"^(tools\[\d+\]|tool_choice|messages\[\d+\]\.tool_calls\[\d+\])\.function(?=\.|$)")


def proto_violations(exc: InvalidRequest) -> InvalidRequest:
    """The same violations, named by GenerateRequest field paths (messages[0] -> chat.messages[0],
    tools[0].function.parameters -> tools[0].parameters)."""
    def path(field: str) -> str:
        field = FUNCTION_LEVEL.sub(r"\1", field)
        head, bracket, rest = field.partition("[")
        return PROTO_FIELDS.get(head, head) + bracket + rest

    return type(exc)([FieldViolation(path(v.field), v.description) for v in exc.violations])


MAX_CHOICES = 16


NO_PARSERS = Parsers()
_READ = object()  # engine_request's `tools` default: read them from the request


def engine_requests(req: pb.GenerateRequest, defaults: SamplingParams, parsers: Parsers = NO_PARSERS,
                    tools: Any = _READ) -> list[Request]:
    """One engine request per sample (GenerateRequest.n): sample j with seed + j when seeded;
    ids get a -j suffix when a client id covers several samples."""
    n = req.n if req.HasField("n") else 1
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidRequest([FieldViolation("n", f"must be in [1, {MAX_CHOICES}], got {n}")])
    return engine_request(req, defaults, parsers, tools).samples(n, numbered=n > 1)


def engine_request(req: pb.GenerateRequest, defaults: SamplingParams, parsers: Parsers = NO_PARSERS,
                   tools: Any = _READ) -> Request:
    """The engine request; every value is checked once, by LLM.build (unknown enum values too).
    `tools`: what tool_request(req) returned, when the caller has read them already; `parsers`:
    the server's (a tools request needs a tool-call parser)."""
    which = req.WhichOneof("input")
    prompt = req.prompt if which == "prompt" else None
    token_ids = list(req.token_ids.ids) if which == "token_ids" else None
    tools = tool_request(req) if tools is _READ else tools
    messages = chat_messages(req) if which == "chat" else None
    kind = req.structured_output.WhichOneof("kind") if req.HasField("structured_output") else None
    value = getattr(req.structured_output, kind) if kind else None
    structured = from_fields(kind, value.values if kind == "choice" else value) if kind else None
    if tools is not None and tools.enforced and structured is not None:  # as tools_api.check_structured
        raise InvalidRequest([FieldViolation("tool_choice", "TOOL_CHOICE_MODE_REQUIRED / _FUNCTION decode the call "
                                                            "under the function's schema; they cannot be combined "
                                                            "with structured_output")])
    structured = tools_api.plan(tools, parsers, structured)  # "required" / named: the parser's enforced call
    extra = {"tools": tools.template_tools()} if tools is not None and tools.tools else {}
    fit = not any(req.HasField(f) for f in ("gen_length", "steps", "block_length"))  # a structure may size it
    return Request(prompt=prompt, token_ids=token_ids, messages=messages, params=sampling_params(req, defaults),
                   request_id=req.request_id, structured=structured, fit_canvas=fit,
                   cache_salt=req.cache_salt if req.HasField("cache_salt") else None, **extra)


def chat_messages(req: pb.GenerateRequest) -> list[dict]:
    """The conversation as the engine takes it (an assistant's tool_calls, a tool result's
    tool_call_id and name), each turn read by the HTTP door's rule (tools_api.message)."""
    v: list[FieldViolation] = []
    out = []
    for i, m in enumerate(req.chat.messages):
        given: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            given["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": c.arguments or "{}"}}
                                   for c in m.tool_calls]
        if m.tool_call_id or m.role == "tool":
            given["tool_call_id"] = m.tool_call_id
        if m.name:
            given["name"] = m.name
        out.append(tools_api.message(i, given, m.content, m.role, v))
    if v:
        raise InvalidRequest(v)
    return out


def tool_request(req: pb.GenerateRequest) -> Optional[ToolRequest]:
    """GenerateRequest.tools, tool_choice and parallel_tool_calls, read by the HTTP door's rules
    (tools_api.from_body over their OpenAI shapes); None: no tools. Chat prompts only."""
    given = [name for name, on in (("tools", len(req.tools) > 0), ("tool_choice", req.HasField("tool_choice")),
                                   ("parallel_tool_calls", req.HasField("parallel_tool_calls"))) if on]
    if not given:
        return None
    if req.WhichOneof("input") != "chat":
        raise InvalidRequest([FieldViolation(name, "only with a chat prompt (GenerateRequest.chat)") for name in given])
    v: list[FieldViolation] = []
    body: dict[str, Any] = {"tools": [_openai_tool(i, t, v) for i, t in enumerate(req.tools)]}
    if req.HasField("tool_choice"):
        body["tool_choice"] = _openai_choice(req.tool_choice, v)
    if req.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = req.parallel_tool_calls
    if v:
        raise InvalidRequest(v)
    tools = tools_api.from_body(body, True, v)
    if v:
        raise InvalidRequest(v)
    return tools


def _openai_tool(i: int, t: pb.Tool, v: list[FieldViolation]) -> dict:
    params = None
    if len(t.parameters) > MAX_SCHEMA_CHARS:  # sizes and nesting before the parser recurses into it
        v.append(FieldViolation(f"tools[{i}].parameters", f"at most {MAX_SCHEMA_CHARS} characters of JSON"))
    elif json_text_depth(t.parameters) > MAX_SCHEMA_NESTING:
        v.append(FieldViolation(f"tools[{i}].parameters", f"nests arrays and objects more than {MAX_SCHEMA_NESTING} deep"))
    elif t.parameters.strip():
        try:
            params = json.loads(t.parameters)
        except ValueError as e:
            v.append(FieldViolation(f"tools[{i}].parameters", f"must be JSON text of a schema object: {e}"))
    fn = {"name": t.name, "description": t.description, "strict": t.strict}
    return {"type": "function", "function": fn | ({"parameters": params} if params is not None else {})}


def _openai_choice(c: pb.ToolChoice, v: list[FieldViolation]) -> Any:
    if c.mode == pb.TOOL_CHOICE_MODE_FUNCTION:
        return {"type": "function", "function": {"name": c.name}}
    if c.name:
        v.append(FieldViolation("tool_choice.name", "only with TOOL_CHOICE_MODE_FUNCTION"))
    if c.mode not in (pb.TOOL_CHOICE_MODE_UNSPECIFIED, *TOOL_CHOICE_TO_OPENAI):
        v.append(FieldViolation("tool_choice.mode", f"unknown enum value {c.mode}"))
    return TOOL_CHOICE_TO_OPENAI.get(c.mode)


def answer_reader(req: pb.GenerateRequest, tools: Optional[ToolRequest], parsers: Parsers) -> Optional[AnswerReader]:
    """How a request's answers are read (None: not read, `text` is the answer): chat prompts whose
    tools are parsed, or any chat prompt when this server has a reasoning parser."""
    if req.WhichOneof("input") != "chat":
        return None
    reader = tools_api.reader(tools, parsers)
    return reader if reader.tool is not None or reader.reasoning is not None else None


def _enum(value: int, table: dict[int, str], unspecified: int = 0) -> Optional[str]:
    """An enum field as the engine's name; None when unset; an unknown value reaches validation
    as a string naming it."""
    if value == unspecified:
        return None
    return table.get(value, f"unknown enum value {value}")


def sampling_params(req: pb.GenerateRequest, defaults: SamplingParams) -> SamplingParams:
    """The knobs a request sets over the defaults, with steps and block length fitted to a
    gen_length given alone (`fit_lengths`). Field names come from the knob table; values are
    checked later, once, by Requests.build (unknown enum values reach it as a string naming them)."""
    given = {}
    for k in on("proto"):
        if k.kind in (STRINGS, IDS):
            if getattr(req, k.proto):
                given[k.name] = tuple(getattr(req, k.proto))
        elif k.kind == CHOICE:
            value = _enum(getattr(req, k.proto), ENUMS_TO_ENGINE[k.name])
            if value is not None:
                given[k.name] = value
        elif req.HasField(k.proto):
            given[k.name] = getattr(req, k.proto)
    if req.stream_options.provisional:  # stream_plan has checked it goes with a delta stream
        given["provisional"] = True
    return fit_lengths(defaults, given)  # knobs gRPC does not carry keep the model's defaults


def stream_plan(req: pb.GenerateRequest) -> StreamPlan:
    o = req.stream_options
    if o.mode not in (pb.STREAM_MODE_UNSPECIFIED, pb.STREAM_MODE_EVERY_K_STEPS,
                      pb.STREAM_MODE_BLOCK_COMPLETE, pb.STREAM_MODE_FINAL_ONLY):
        raise InvalidRequest([FieldViolation("stream_options.mode", f"unknown enum value {o.mode}")])
    if o.mode == pb.STREAM_MODE_EVERY_K_STEPS and o.every_k_steps < 1:
        raise InvalidRequest([FieldViolation("stream_options.every_k_steps", "must be >= 1 with STREAM_MODE_EVERY_K_STEPS")])
    if o.mode != pb.STREAM_MODE_EVERY_K_STEPS and o.every_k_steps:
        raise InvalidRequest([FieldViolation("stream_options.every_k_steps", "only valid with STREAM_MODE_EVERY_K_STEPS")])
    if o.format not in (pb.SNAPSHOT_FORMAT_UNSPECIFIED, pb.SNAPSHOT_FORMAT_FULL, pb.SNAPSHOT_FORMAT_DELTA):
        raise InvalidRequest([FieldViolation("stream_options.format", f"unknown enum value {o.format}")])
    if o.provisional and o.format != pb.SNAPSHOT_FORMAT_DELTA:
        raise InvalidRequest([FieldViolation("stream_options.provisional", "only valid with SNAPSHOT_FORMAT_DELTA")])
    if o.provisional and o.mode in (pb.STREAM_MODE_BLOCK_COMPLETE, pb.STREAM_MODE_FINAL_ONLY):
        why = "needs messages sent within a block (every step or every k steps): this mode sends none"
        raise InvalidRequest([FieldViolation("stream_options.provisional", why)])
    return StreamPlan(o.mode, max(1, o.every_k_steps), o.format == pb.SNAPSHOT_FORMAT_DELTA, o.provisional)


def snapshot(ev: StepEvent, tok: Tokenizer, committed: dict[int, float]) -> pb.GenerateResponse:
    """A full (replace, not delta) snapshot; `committed` = positions since the last sent message."""
    positions = sorted(committed)
    msg = pb.GenerateResponse(
        request_id=ev.request_id, step=ev.step + 1, total_steps=ev.total_steps, block_index=ev.block,
        num_blocks=ev.num_blocks,
        text=tok.decode_cut(ev.generated, ev.stop_text) if ev.stop_text else tok.render(ev.canvas[:ev.visible]),
        committed_positions=positions, committed_confidences=[committed[p] for p in positions], done=ev.finished,
        final_positions=ev.settled, revising=ev.revising)
    add, text, mask = msg.tokens.add, tok.token_text, tok.mask_id  # built in place: no copy of each token
    for i, t in enumerate(ev.canvas):  # fields left at their proto3 default are simply not set
        token = add(id=t, text=text(t), masked=t == mask, final=ev.is_final(i, mask))
        if i in committed:
            token.committed_this_step, token.confidence = True, committed[i]
    return msg


def finalize(msg: pb.GenerateResponse, ev: StepEvent, elapsed_s: float, tok: Tokenizer,
             reader: Optional[AnswerReader] = None, choice: int = 0) -> pb.GenerateResponse:
    finish = ev.finish_reason or FinishReason.LENGTH
    msg.finish_reason = FINISH_TO_PB[finish]
    if reader is not None:  # the final text read as the HTTP door reads it: reasoning, content, calls
        answer = reader.read(tool_answers.answer_text(tok, ev.generated, ev.stop_text), ev.request_id, choice)
        msg.tool_calls.extend(pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in answer.calls)
        if answer.reasoning is not None:
            msg.reasoning = answer.reasoning
        if answer.content is not None:
            msg.content = answer.content
        if tool_answers.finish_reason(answer, finish.value) == "tool_calls":
            msg.finish_reason = pb.FINISH_REASON_TOOL_CALLS
    msg.seed = ev.seed
    msg.usage.CopyFrom(pb.Usage(prompt_tokens=ev.prompt_tokens, generated_tokens=len(ev.generated),
                                forward_passes=ev.forward_passes, cached_tokens=ev.cached_tokens,
                                verify_passes=ev.verify_passes, accepted_tokens=ev.accepted_tokens))
    msg.elapsed.CopyFrom(Duration(seconds=int(elapsed_s), nanos=int((elapsed_s % 1) * 1e9)))
    msg.kv_cache = KV_CACHE_TO_PB[ev.kv_cache]
    for token, (lp, top) in zip(msg.tokens, ev.logprobs):  # with logprobs: every generated token
        token.logprob = lp
        token.top_logprobs.extend(pb.TokenLogprob(id=i, text=tok.token_text(i), logprob=v) for i, v in top)
    if ev.choice_probabilities is not None:  # typed decisions: a choice asked with logprobs
        msg.choice_probabilities.extend(pb.ChoiceProbability(option=k, probability=v)
                                        for k, v in ev.choice_probabilities.items())
    return msg


def delta_message(ev: StepEvent, d: CanvasDelta, provisional: bool) -> pb.GenerateResponse:
    """The engine's canvas delta as a message: O(changed positions), no full decode."""
    return pb.GenerateResponse(
        request_id=ev.request_id, step=ev.step + 1, total_steps=ev.total_steps, block_index=ev.block,
        num_blocks=ev.num_blocks, committed_positions=d.committed, committed_confidences=d.confidences,
        text_positions=d.visible, final_positions=d.settled, revising=ev.revising,
        updates=[pb.TokenUpdate(position=c.position, token=pb.Token(id=c.id, text=c.text, masked=c.masked,
                                                                     final=c.final, piece=c.piece))
                 for c in d.cells],
        provisional=[pb.TokenUpdate(position=g.position, token=pb.Token(id=g.id, text=g.text, confidence=g.confidence))
                     for g in (d.provisional if provisional else ())])


@dataclass
class ChoiceFormatter:
    """Builds the messages of one choice from its step events (None: nothing to send this step).

    Called by the formatter thread, in step order, never on the event loop. Keeps what a delta needs
    between messages: positions committed since the last message sent and the engine's canvas deltas."""

    plan: StreamPlan
    tok: Tokenizer
    choice: int
    prepared: Prepared  # read once, here: its params
    t0: float = field(default_factory=time.perf_counter)  # admission: `elapsed` counts from here
    committed: dict[int, float] = field(default_factory=dict)  # since the last message sent
    deltas: Optional[CanvasDeltas] = None
    first: bool = True
    lengths: tuple[int, int] = (0, 0)  # (gen_length, block_length)
    reader: Optional[AnswerReader] = None  # reads the final text (tool calls, reasoning); None: not read

    def __post_init__(self) -> None:
        self.lengths = (self.prepared.params.gen_length, self.prepared.params.block_length)
        if self.plan.delta:
            self.deltas = CanvasDeltas(self.tok, self.lengths[0])

    def __call__(self, ev: StepEvent) -> Optional[pb.GenerateResponse]:
        self.committed.update(zip(ev.committed, ev.confidences))
        if not self.plan.wants(ev):
            return None
        committed, self.committed = self.committed, {}
        d = self.deltas.delta(ev, committed) if self.deltas is not None else None
        msg = snapshot(ev, self.tok, committed) if d is None else delta_message(ev, d, self.plan.provisional)
        msg.choice = self.choice
        if self.plan.delta:
            msg.format = pb.SNAPSHOT_FORMAT_DELTA
            if self.first:
                msg.layout.CopyFrom(self.layout(ev))
        self.first = False
        if ev.finished:
            finalize(msg, ev, time.perf_counter() - self.t0, self.tok, self.reader, self.choice)
        return msg

    def layout(self, ev: StepEvent) -> pb.CanvasLayout:
        gen_length, block_length = self.lengths
        return pb.CanvasLayout(gen_length=gen_length, block_length=block_length, num_blocks=ev.num_blocks,
                               prompt_tokens=ev.prompt_tokens, mask_token_id=self.tok.mask_id, mask_text=MASK_MARKER,
                               revising=ev.revising)


def model_info(llm, name: str = "") -> pb.GetModelInfoResponse:
    """`name`: the served model name (--served-model-name), else the model's own."""
    cfg, ec, d = llm.model_config, llm.config, llm.defaults
    return pb.GetModelInfoResponse(
        name=name or llm.name, architecture=cfg.arch, parameter_count=llm.parameter_count, vocab_size=cfg.vocab_size,
        mask_token_id=cfg.mask_token_id, eos_token_id=cfg.eos_token_id,
        limits=pb.Limits(max_prompt_tokens=ec.max_prompt_tokens, max_gen_length=ec.max_gen_length,
                         max_batch=ec.max_batch, max_queue=ec.max_queue),
        defaults=pb.SamplingDefaults(gen_length=d.gen_length, steps=d.steps, block_length=d.block_length,
                                     temperature=d.temperature, remasking=REMASKING_TO_PB[d.remasking],
                                     kv_cache=KV_CACHE_TO_PB[llm.kv_cache], schedule=SCHEDULE_TO_PB[d.schedule],
                                     frequency_penalty=d.frequency_penalty, presence_penalty=d.presence_penalty,
                                     max_denoising_steps=d.max_denoising_steps, entropy_bound=d.entropy_bound,
                                     t_min=d.t_min, t_max=d.t_max, stability_threshold=d.stability_threshold,
                                     confidence_threshold=d.confidence_threshold),
        dtype=ec.dtype, device=ec.device, family=llm.family.kind, token_editing=llm.family.edits,
        decoding_modes=llm.family.modes)
