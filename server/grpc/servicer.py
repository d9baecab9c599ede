"""Thin gRPC handlers: convert, hand to the door-neutral pipeline (server/pipeline.py), convert back."""

from __future__ import annotations

import asyncio
import functools
from typing import AsyncIterator

import grpc

from celeris.v1 import generation_pb2 as pb
from celeris.v1 import generation_pb2_grpc as pb_grpc
from celeris.engine.errors import EngineError, InvalidRequest
from celeris.engine.requests import Request
from celeris.engine.serving import LLM, FormatterFactory
from celeris.server.grpc import convert
from celeris.server.errors import abort
from celeris.server.pipeline import Pipeline

GENERATE = "celeris.v1.GenerationService/Generate"


def _carrier(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, llm: LLM, pipeline: Pipeline, served_name: str = ""):
        self.llm, self.pipeline = llm, pipeline
        self.served_name = served_name or llm.name  # --served-model-name, else the model's own

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        async with self.pipeline.call("grpc", GENERATE, _carrier(context), context.peer(), request.prompt) as call:
            try:
                await call.open(*await self._mapped(request))  # all samples (GenerateRequest.n) or none
                if call.structure_path:  # as HTTP's x-celeris-structure-path header
                    await context.send_initial_metadata((("x-celeris-structure-path", call.structure_path),))
            except EngineError as e:
                await abort(context, call.fail(convert.proto_violations(e) if isinstance(e, InvalidRequest) else e))
            try:
                async for message in call.messages():
                    yield message
            except Exception as e:  # a failed step, or a formatting bug (INTERNAL)
                await abort(context, e)

    async def _mapped(self, request: pb.GenerateRequest) -> tuple[list[Request], list[FormatterFactory]]:
        """The engine requests of each sample and the makers of their message formatters (messages are
        built off the loop). Tools are checked by compiling their schemas: on a worker thread."""
        parsers = self.pipeline.parsers
        plan = convert.stream_plan(request)
        tools = (await asyncio.to_thread(convert.tool_request, request) if request.tools
                 else convert.tool_request(request))
        reqs = convert.engine_requests(request, self.llm.defaults, parsers, tools)
        reader = convert.answer_reader(request, tools, parsers)  # tool calls, reasoning
        return reqs, [functools.partial(convert.ChoiceFormatter, plan, self.llm.tokenizer, k, reader=reader)
                      for k in range(len(reqs))]

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.GetModelInfoResponse:
        return convert.model_info(self.llm, self.served_name)

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        try:
            ids, tokens = await self.llm.tokenize_async(request.text, request.apply_chat_template)
            return pb.TokenizeResponse(ids=ids, tokens=tokens)
        except EngineError as e:
            await abort(context, e)
