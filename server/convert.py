"""The only protobuf <-> engine mapping."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Optional

from google.protobuf.duration_pb2 import Duration

from celeris.v1 import generation_pb2 as pb
from engine.errors import FieldViolation, InvalidRequest
from engine.params import SamplingParams
from engine.sequence import FinishReason, StepEvent
from engine.tokenizer import Tokenizer

MAX_REQUEST_ID = 128
CHAT_ROLES = ("system", "user", "assistant")

REMASKING_TO_ENGINE = {
    pb.REMASKING_LOW_CONFIDENCE: "low_confidence",
    pb.REMASKING_RANDOM: "random",
    pb.REMASKING_MARGIN: "margin",
    pb.REMASKING_ENTROPY: "entropy",
}
REMASKING_TO_PB = {v: k for k, v in REMASKING_TO_ENGINE.items()}
FINISH_TO_PB = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}


@dataclass(frozen=True)
class StreamPlan:
    """Which snapshots of a request to send."""

    mode: int = pb.STREAM_MODE_UNSPECIFIED
    every_k: int = 1

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


@dataclass(frozen=True)
class Input:
    """A prompt as the engine's LLM.encode_prompt takes it."""

    text: str = ""
    token_ids: Optional[list[int]] = None
    messages: Optional[list[dict]] = None


# Engine field names -> the GenerateRequest field paths a client sees in BadRequest.
PROTO_FIELDS = {"messages": "chat.messages", "token_ids": "token_ids.ids"}


def proto_violations(exc: InvalidRequest) -> InvalidRequest:
    """The same violations, named by GenerateRequest field paths (messages[0] -> chat.messages[0])."""
    def path(field: str) -> str:
        head, bracket, rest = field.partition("[")
        return PROTO_FIELDS.get(head, head) + bracket + rest

    return InvalidRequest([FieldViolation(path(v.field), v.description) for v in exc.violations])


def request_id(req: pb.GenerateRequest) -> str:
    if len(req.request_id) > MAX_REQUEST_ID:
        raise InvalidRequest([FieldViolation("request_id", f"at most {MAX_REQUEST_ID} characters")])
    return req.request_id or uuid.uuid4().hex


def request_input(req: pb.GenerateRequest) -> Input:
    which = req.WhichOneof("input")
    if which == "prompt":
        return Input(text=req.prompt)
    if which == "token_ids":
        return Input(token_ids=list(req.token_ids.ids))
    if which == "chat":
        msgs = [{"role": m.role, "content": m.content} for m in req.chat.messages]
        bad = [FieldViolation(f"chat.messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}, got {m['role']!r}")
               for i, m in enumerate(msgs) if m["role"] not in CHAT_ROLES]
        if bad:
            raise InvalidRequest(bad)
        return Input(messages=msgs)
    raise InvalidRequest([FieldViolation("input", "set one of prompt, token_ids or chat")])


def sampling_params(req: pb.GenerateRequest, defaults: SamplingParams) -> SamplingParams:
    """Unset knobs take the defaults; every value is checked later by SamplingParams.validate."""
    v: list[FieldViolation] = []
    if req.remasking not in (pb.REMASKING_UNSPECIFIED, *REMASKING_TO_ENGINE):
        v.append(FieldViolation("remasking", f"unknown enum value {req.remasking}"))
    floats = {}
    for name in ("temperature", "threshold", "factor", "cfg_scale"):
        if req.HasField(name):
            x = getattr(req, name)
            if not math.isfinite(x):
                v.append(FieldViolation(name, f"must be a finite number, got {x}"))
            floats[name] = x
    if v:
        raise InvalidRequest(v)
    return SamplingParams(
        gen_length=req.gen_length if req.HasField("gen_length") else defaults.gen_length,
        steps=req.steps if req.HasField("steps") else defaults.steps,
        block_length=req.block_length if req.HasField("block_length") else defaults.block_length,
        temperature=floats.get("temperature", defaults.temperature),
        remasking=REMASKING_TO_ENGINE.get(req.remasking, defaults.remasking),
        threshold=floats.get("threshold", defaults.threshold),
        factor=floats.get("factor", defaults.factor),
        cfg_scale=floats.get("cfg_scale", defaults.cfg_scale),
        seed=req.seed if req.HasField("seed") else defaults.seed,
    )


def stream_plan(req: pb.GenerateRequest) -> StreamPlan:
    o = req.stream_options
    if o.mode not in (pb.STREAM_MODE_UNSPECIFIED, pb.STREAM_MODE_EVERY_K_STEPS,
                      pb.STREAM_MODE_BLOCK_COMPLETE, pb.STREAM_MODE_FINAL_ONLY):
        raise InvalidRequest([FieldViolation("stream_options.mode", f"unknown enum value {o.mode}")])
    if o.mode == pb.STREAM_MODE_EVERY_K_STEPS and o.every_k_steps < 1:
        raise InvalidRequest([FieldViolation("stream_options.every_k_steps", "must be >= 1 with STREAM_MODE_EVERY_K_STEPS")])
    if o.mode != pb.STREAM_MODE_EVERY_K_STEPS and o.every_k_steps:
        raise InvalidRequest([FieldViolation("stream_options.every_k_steps", "only valid with STREAM_MODE_EVERY_K_STEPS")])
    return StreamPlan(o.mode, max(1, o.every_k_steps))


def snapshot(ev: StepEvent, tok: Tokenizer, params: SamplingParams, committed: dict[int, float]) -> pb.GenerateResponse:
    """A full (replace, not delta) snapshot; `committed` = positions since the last sent message."""
    visible = list(ev.canvas)
    for i, t in enumerate(visible):  # text stops at the first committed stop token
        if t in tok.stop_ids:
            visible = visible[:i]
            break
    tokens = [pb.Token(id=t, text=tok.token_text(t), masked=t == tok.mask_id,
                       committed_this_step=i in committed, confidence=committed.get(i, 0.0))
              for i, t in enumerate(ev.canvas)]
    positions = sorted(committed)
    return pb.GenerateResponse(
        request_id=ev.request_id, step=ev.step + 1, total_steps=planned_steps(params), block_index=ev.block,
        num_blocks=ev.num_blocks, text=tok.render(visible), tokens=tokens, committed_positions=positions,
        committed_confidences=[committed[p] for p in positions], done=ev.finished)


def planned_steps(params: SamplingParams) -> int:
    """The fixed schedule runs `steps`; threshold/factor rules run each block until it has no
    masks, between 1 and block_length steps, so at most gen_length in all."""
    return params.gen_length if params.adaptive else params.steps


def finalize(msg: pb.GenerateResponse, ev: StepEvent, seed: int, prompt_tokens: int, generated: int,
             elapsed_s: float) -> pb.GenerateResponse:
    msg.finish_reason = FINISH_TO_PB[ev.finish_reason or FinishReason.LENGTH]
    msg.seed = seed
    msg.usage.CopyFrom(pb.Usage(prompt_tokens=prompt_tokens, generated_tokens=generated,
                                forward_passes=ev.forward_passes))
    msg.elapsed.CopyFrom(Duration(seconds=int(elapsed_s), nanos=int((elapsed_s % 1) * 1e9)))
    return msg


def model_info(llm) -> pb.GetModelInfoResponse:
    cfg, ec, d = llm.model_config, llm.config, llm.defaults
    return pb.GetModelInfoResponse(
        name=llm.name, architecture=cfg.arch, parameter_count=llm.parameter_count, vocab_size=cfg.vocab_size,
        mask_token_id=cfg.mask_token_id, eos_token_id=cfg.eos_token_id,
        limits=pb.Limits(max_prompt_tokens=ec.max_prompt_tokens, max_gen_length=ec.max_gen_length,
                         max_batch=ec.max_batch, max_queue=ec.max_queue),
        defaults=pb.SamplingDefaults(gen_length=d.gen_length, steps=d.steps, block_length=d.block_length,
                                     temperature=d.temperature, remasking=REMASKING_TO_PB[d.remasking]),
        dtype=ec.dtype, device=ec.device)
