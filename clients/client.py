"""Python client for a Celeris server, sync (`CelerisClient`) and asyncio (`AsyncCelerisClient`).

    with CelerisClient("localhost:50051") as c:
        print(c.generate("Once upon a time", gen_length=64, steps=32).text)
        for snap in c.stream("Once upon a time", steps=16):
            print(snap.step, snap.masked_count, snap.text)

Knobs (all optional, server defaults otherwise): gen_length, steps, block_length, temperature,
remasking ("low_confidence", "random", "margin", "entropy"), threshold, factor, cfg_scale, seed;
plus request_id, stream_mode ("every_step", "every_k_steps", "block_complete", "final_only"),
every_k_steps and stream_format ("delta", the default here, or "full") for `stream`, and timeout
(seconds, the whole call including retries). With "delta" the server sends only what changed and
`celeris_client.canvas.Canvas` rebuilds every Snapshot, so callers see the same records either way.

Tools (chat prompts, docs/tools.md): `tools=` (OpenAI's list), `tool_choice=` ("none", "auto",
"required" or {"type": "function", "function": {"name": ...}}) and `parallel_tool_calls=`; the
Result (and the last Snapshot) carries `tool_calls`, `reasoning` and `content`, and
`Result.message()` is the assistant turn to send back before the tool results:

    res = c.generate(messages, tools=tools, tool_choice="required")
    messages += [res.message(), *({"role": "tool", "tool_call_id": call.id, "content": run(call)}
                                  for call in res.tool_calls)]
    print(c.generate(messages, tools=tools).content)

Retries: UNAVAILABLE, RESOURCE_EXHAUSTED and CANCELLED (never this client's own: a call crossing a
draining server's GOAWAY) are retried with exponential backoff and jitter, never sooner than the
server's RetryInfo delay, and only while the client's retry budget allows (gRPC's retry
throttling, `errors.RetryBudget`: one budget per client, so a burst of failing calls makes at most
about 1.1x as many attempts, docs/limits.md). A stream is retried only if it failed before its
first message: a half-delivered stream is never replayed. Importable without torch.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from typing import Any, AsyncIterator, Iterator, Optional

import grpc

from celeris.v1 import generation_pb2 as pb
from celeris.v1 import generation_pb2_grpc as pb_grpc
from celeris_client.canvas import Canvas
from celeris_client.errors import CelerisError, DeadlineExceeded, RetryBudget, RetryPolicy, error_from_rpc, is_retryable
from celeris_client.types import ModelInfo, Prompt, Result, Snapshot, Tokenization, build_request

DEFAULT_TARGET = "localhost:50051"


def is_loopback(target: str) -> bool:
    if target.startswith(("unix:", "unix-abstract:")):
        return True
    host = target.rsplit(":", 1)[0] if target.count(":") == 1 or target.startswith("[") else target
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _delta_default(knobs: dict[str, Any]) -> dict[str, Any]:
    """Streams ask for deltas unless the caller chose a format: far fewer bytes, same Snapshots."""
    return {"stream_format": "delta"} | {k: v for k, v in knobs.items() if not (k == "stream_format" and not v)}


def _results(finals: list[Snapshot], n: int) -> list[Result]:
    """One Result per choice, in choice order, from the stream's done=true messages."""
    by_choice = {s.choice: s for s in finals}
    if sorted(by_choice) != list(range(n)):  # the protocol promises one per choice; say so if not
        raise CelerisError(grpc.StatusCode.INTERNAL, "Generate stream ended without a done=true message per choice")
    return [Result.from_snapshot(by_choice[k]) for k in range(n)]


class _Base:
    """Connection settings and per-call bookkeeping shared by the sync and asyncio clients."""

    def __init__(self, target: str = DEFAULT_TARGET, *, token: Optional[str] = None,
                 insecure: Optional[bool] = None, root_certificates: Optional[bytes] = None,
                 timeout: Optional[float] = None, retry: RetryPolicy = RetryPolicy(),
                 options: tuple[tuple[str, Any], ...] = (), budget: Optional[RetryBudget] = None):
        """`insecure`: True = plaintext, False = TLS (system roots unless `root_certificates`);
        None = plaintext for loopback targets without root certificates, TLS otherwise.
        `budget`: the retry budget, shared by every call of this client (one channel, one
        target); pass one budget to several clients of the same server to share it too."""
        self.target, self.timeout, self.retry = target, timeout, retry
        self.budget = budget if budget is not None else retry.budget()
        if insecure is None:
            insecure = root_certificates is None and is_loopback(target)
        self.insecure = insecure
        self._credentials = None if insecure else grpc.ssl_channel_credentials(root_certificates)
        self._options = list(options)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel = self._open_channel()
        self._stub = pb_grpc.GenerationServiceStub(self._channel)

    def _open_channel(self) -> Any:
        raise NotImplementedError

    def _deadline(self, timeout: Optional[float]) -> Optional[float]:
        timeout = self.timeout if timeout is None else timeout
        return None if timeout is None else time.monotonic() + timeout

    @staticmethod
    def _remaining(deadline: Optional[float]) -> Optional[float]:
        if deadline is None:
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded before the call started")
        return left

    def _backoff(self, err: CelerisError, attempt: int, deadline: Optional[float]) -> float:
        """The wait before the next attempt; re-raises `err` when no retry is due, the budget
        is spent, or the wait can't fit the deadline. Every retryable failure is charged to the
        budget, the last attempt's too: the budget measures how the server is doing."""
        allowed = self.budget.failed() if is_retryable(err) else False
        delay = self.retry.delay(err, attempt)
        if delay is None or not allowed or (deadline is not None and time.monotonic() + delay >= deadline):
            raise err
        return delay


class CelerisClient(_Base):
    """Blocking client. Use as a context manager, or call close()."""

    def _open_channel(self) -> grpc.Channel:
        if self.insecure:
            return grpc.insecure_channel(self.target, options=self._options)
        return grpc.secure_channel(self.target, self._credentials, options=self._options)

    def __enter__(self) -> CelerisClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _unary(self, method: Any, request: Any, timeout: Optional[float]) -> Any:
        deadline, attempt = self._deadline(timeout), 1
        while True:
            try:
                reply = method(request, timeout=self._remaining(deadline), metadata=self._metadata)
                self.budget.succeeded()
                return reply
            except grpc.RpcError as e:
                err = error_from_rpc(e)
            time.sleep(self._backoff(err, attempt, deadline))
            attempt += 1

    def model_info(self, *, timeout: Optional[float] = None) -> ModelInfo:
        return ModelInfo.from_pb(self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout))

    def tokenize(self, text: str, *, chat: bool = False, timeout: Optional[float] = None) -> Tokenization:
        resp = self._unary(self._stub.Tokenize, pb.TokenizeRequest(text=text, apply_chat_template=chat), timeout)
        return Tokenization(tuple(resp.ids), tuple(resp.tokens))

    def stream(self, prompt: Prompt, *, timeout: Optional[float] = None, **knobs: Any) -> Iterator[Snapshot]:
        """Yield snapshots as the canvas refines; the last one has done=True. Closing the
        iterator early cancels the request on the server."""
        request = build_request(prompt, **_delta_default(knobs))
        deadline, attempt = self._deadline(timeout), 1
        while True:
            call = self._stub.Generate(request, timeout=self._remaining(deadline), metadata=self._metadata)
            started, canvas = False, Canvas()
            try:
                for msg in call:
                    if not started:  # admitted: what the budget counts as a success
                        started = True
                        self.budget.succeeded()
                    yield canvas.snapshot(msg)
                return
            except grpc.RpcError as e:
                err = error_from_rpc(e)
                if started:
                    raise err from None
            finally:
                call.cancel()  # no-op once the stream is complete; frees the server slot otherwise
            time.sleep(self._backoff(err, attempt, deadline))
            attempt += 1

    def generate(self, prompt: Prompt, *, timeout: Optional[float] = None, **knobs: Any) -> Result:
        """Run one generation and return its final result (only the last message is sent)."""
        return self.sample(prompt, 1, timeout=timeout, **knobs)[0]

    def sample(self, prompt: Prompt, n: int, *, timeout: Optional[float] = None, **knobs: Any) -> list[Result]:
        """n samples of one prompt, decoded together on the server (sample j: seed + j)."""
        knobs.setdefault("stream_mode", "final_only")
        return _results([s for s in self.stream(prompt, timeout=timeout, n=n, **knobs) if s.done], n)


class AsyncCelerisClient(_Base):
    """asyncio client; same methods as CelerisClient, as coroutines / an async iterator. Create it
    inside the event loop that will use it (grpc.aio binds the channel to the running loop)."""

    def _open_channel(self) -> grpc.aio.Channel:
        if self.insecure:
            return grpc.aio.insecure_channel(self.target, options=self._options)
        return grpc.aio.secure_channel(self.target, self._credentials, options=self._options)

    async def __aenter__(self) -> AsyncCelerisClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _unary(self, method: Any, request: Any, timeout: Optional[float]) -> Any:
        deadline, attempt = self._deadline(timeout), 1
        while True:
            try:
                reply = await method(request, timeout=self._remaining(deadline), metadata=self._metadata)
                self.budget.succeeded()
                return reply
            except grpc.RpcError as e:
                err = error_from_rpc(e)
            await asyncio.sleep(self._backoff(err, attempt, deadline))
            attempt += 1

    async def model_info(self, *, timeout: Optional[float] = None) -> ModelInfo:
        return ModelInfo.from_pb(await self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout))

    async def tokenize(self, text: str, *, chat: bool = False, timeout: Optional[float] = None) -> Tokenization:
        req = pb.TokenizeRequest(text=text, apply_chat_template=chat)
        resp = await self._unary(self._stub.Tokenize, req, timeout)
        return Tokenization(tuple(resp.ids), tuple(resp.tokens))

    async def stream(self, prompt: Prompt, *, timeout: Optional[float] = None,
                     **knobs: Any) -> AsyncIterator[Snapshot]:
        """Async-iterate snapshots; leaving the loop early (break, aclose) cancels the request."""
        request = build_request(prompt, **_delta_default(knobs))
        deadline, attempt = self._deadline(timeout), 1
        while True:
            call = self._stub.Generate(request, timeout=self._remaining(deadline), metadata=self._metadata)
            started, canvas = False, Canvas()
            try:
                async for msg in call:
                    if not started:  # admitted: what the budget counts as a success
                        started = True
                        self.budget.succeeded()
                    yield canvas.snapshot(msg)
                return
            except grpc.RpcError as e:
                err = error_from_rpc(e)
                if started:
                    raise err from None
            finally:
                call.cancel()
            await asyncio.sleep(self._backoff(err, attempt, deadline))
            attempt += 1

    async def generate(self, prompt: Prompt, *, timeout: Optional[float] = None, **knobs: Any) -> Result:
        return (await self.sample(prompt, 1, timeout=timeout, **knobs))[0]

    async def sample(self, prompt: Prompt, n: int, *, timeout: Optional[float] = None, **knobs: Any) -> list[Result]:
        knobs.setdefault("stream_mode", "final_only")
        return _results([s async for s in self.stream(prompt, timeout=timeout, n=n, **knobs) if s.done], n)
