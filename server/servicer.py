"""Thin gRPC handlers: convert, hand to the scheduler, convert back."""

from __future__ import annotations

import time
from typing import AsyncIterator

import grpc

from celeris.v1 import generation_pb2 as pb
from celeris.v1 import generation_pb2_grpc as pb_grpc
from engine.errors import EngineError, FieldViolation, InvalidRequest
from engine.llm import LLM
from engine.scheduler import Scheduler
from server import convert
from server.errors import abort
from server.telemetry import Telemetry

MAX_TOKENIZE_BYTES = 1 << 20


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, llm: LLM, scheduler: Scheduler, telemetry: Telemetry):
        self.llm, self.scheduler, self.telemetry = llm, scheduler, telemetry

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        with self.telemetry.request(context, request) as obs:
            try:
                rid = convert.request_id(request)
                obs.bind(rid)
                inp = convert.request_input(request)
                params = convert.sampling_params(request, self.llm.defaults)
                plan = convert.stream_plan(request)
                seq = self.llm.request(inp.token_ids if inp.token_ids is not None else inp.text, params,
                                       messages=inp.messages, request_id=rid)
                prompt = seq.prompt
            except EngineError as e:
                e = convert.proto_violations(e) if isinstance(e, InvalidRequest) else e
                obs.fail(e)
                await abort(context, e)
            events = self.scheduler.generate(seq)
            committed: dict[int, float] = {}
            t0 = time.perf_counter()
            try:
                async for ev in events:
                    obs.step(ev)
                    committed.update(zip(ev.committed, ev.confidences))
                    if not plan.wants(ev):
                        continue
                    msg = convert.snapshot(ev, self.llm.tokenizer, seq.params, committed)
                    committed = {}
                    if ev.finished:
                        generated = len(seq.generated())
                        convert.finalize(msg, ev, seq.params.seed or 0, len(prompt), generated,
                                         time.perf_counter() - t0)
                        obs.finish(ev, generated)
                    yield msg
            except EngineError as e:  # Overloaded / Unavailable at admission
                obs.fail(e)
                await abort(context, e)
            finally:
                await events.aclose()

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.GetModelInfoResponse:
        return convert.model_info(self.llm)

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        try:
            if len(request.text.encode()) > MAX_TOKENIZE_BYTES:
                raise InvalidRequest([FieldViolation("text", f"at most {MAX_TOKENIZE_BYTES} bytes")])
            tok = self.llm.tokenizer
            text = request.text
            if request.apply_chat_template:
                text = tok.apply_chat_template([{"role": "user", "content": text}])
            ids = tok.encode(text) if text else []
            return pb.TokenizeResponse(ids=ids, tokens=tok.tokens(ids))
        except EngineError as e:
            await abort(context, e)
