"""Thin gRPC handlers: convert, hand to the shared request lifecycle, convert back."""

from __future__ import annotations

import asyncio
import functools
from typing import AsyncIterator, Optional

import grpc

from celeris.v1 import generation_pb2 as pb
from celeris.v1 import generation_pb2_grpc as pb_grpc
from celeris.engine.errors import EngineError, InvalidRequest
from celeris.engine.serving import LLM
from celeris.server.grpc import convert
from celeris.server.errors import abort
from celeris.server.lifecycle import Lifecycle, merged_events
from celeris.server.tools_api import Parsers, resolve

GENERATE = "celeris.v1.GenerationService/Generate"


def _carrier(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, llm: LLM, lifecycle: Lifecycle, served_name: str = "", parsers: Optional[Parsers] = None):
        self.llm, self.lifecycle = llm, lifecycle
        self.served_name = served_name or llm.name  # --served-model-name, else the model's own
        # Tool-call and reasoning parsers (--tool-call-parser / --reasoning-parser, else detected from
        # the chat template): the HTTP gateway's, resolved the same way when none are handed in.
        self.parsers = parsers if parsers is not None else resolve(llm.tokenizer.chat_template,
                                                                          specials=llm.tokenizer.special_markers)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        start = lambda: self.lifecycle.start("grpc", GENERATE, _carrier(context), context.peer(),  # noqa: E731
                                             request.prompt)
        lives = [start()]
        try:
            try:
                plan = convert.stream_plan(request)
                # Tools are checked by compiling their schemas: on a worker thread, never the loop.
                tools = (await asyncio.to_thread(convert.tool_request, request) if request.tools
                         else convert.tool_request(request))
                reqs = convert.engine_requests(request, self.llm.defaults, self.parsers, tools)
                reader = convert.answer_reader(request, tools, self.parsers)  # tool calls, reasoning
                lives += [start() for _ in reqs[1:]]  # one request lifecycle per sample (GenerateRequest.n)
                formatters = [functools.partial(convert.ChoiceFormatter, plan, self.llm.tokenizer, k, reader=reader)
                              for k in range(len(reqs))]  # messages are built off the loop
                streams = await self.lifecycle.submit(lives, reqs, formatters)  # all samples or none
                if (path := streams[0].structure_path):  # as HTTP's x-celeris-structure-path header
                    await context.send_initial_metadata((("x-celeris-structure-path", path),))
            except EngineError as e:
                e = convert.proto_violations(e) if isinstance(e, InvalidRequest) else e
                lives[0].fail(e)
                await abort(context, e)
            try:
                async for ev in merged_events(lives):
                    if isinstance(ev.formatted, Exception):  # a formatting bug: INTERNAL
                        lives[0].fail(ev.formatted)
                        await abort(context, ev.formatted)
                    if ev.formatted is not None:
                        yield ev.formatted
            except EngineError as e:  # a failed step
                await abort(context, e)
        finally:
            for life in lives:
                life.close()

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.GetModelInfoResponse:
        return convert.model_info(self.llm, self.served_name)

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        try:
            ids, tokens = await self.llm.tokenize_async(request.text, request.apply_chat_template)
            return pb.TokenizeResponse(ids=ids, tokens=tokens)
        except EngineError as e:
            await abort(context, e)
