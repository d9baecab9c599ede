"""OpenAI-shaped response bodies and server-sent-event chunks built from engine StepEvents.

Streaming has two modes:
- plain (`stream: true`): append-only text deltas, as OpenAI clients expect. A diffusion model
  has no left-to-right order, but a finished block never changes, so each completed block's new
  text is sent as a delta and the final chunk carries the rest, finish_reason and usage.
- diffusing, delta (`stream: true, diffusing: true` or `"delta"`, the default): each event's
  `celeris` object carries only the cells that changed since the previous event (`updates`:
  {"i", "text", "masked", "final", and "piece" where it differs from text}), the positions committed
  this step (`new`), `final_positions` and `visible` (text is echo + the pieces of cells [0, visible); cells from there on
  are "stop"); the first event adds `layout` {gen_length, num_blocks, prompt_tokens, mask_text,
  echo, revising}, and the usual text field stays empty. Final vs provisional (as the proto's
  contract): a cell with "final": true never changes again; with a revising model (DiffusionGemma,
  layout "revising": true) an unmasked cell may be replaced by a later update until it is final,
  and every cell that became final is listed in `updates`, changed or not. Cells [0,
  final_positions) are final in every family. With `provisional: true` each event before the last
  also carries `provisional`: [{"i", "text", "confidence"}], the sampler's pick at each cell of the
  current block it ranked this step and left masked (replacing the previous event's list whole).
  The last event is a whole snapshot, as below, with the final text. Each event maps the
  engine's `events.CanvasDelta` (the record gRPC's delta messages map too), O(changed cells).
- diffusing, full (`diffusing: "full"`): every event carries the whole canvas as text (replace,
  not append) in the usual field (choices[].text / delta.content), plus a `celeris` object saying
  so, with step / block counters, `final_positions` and each position's state (and "final") for
  live views.

Plain streaming sends only final text in every family: a finished block, or a revising model's
stopped canvas, is final; the canvas a revising model is still denoising is never sent.

A chat answer read by parsers (a request with tools, or a server with a reasoning parser:
server/tool_answers.py) is read whole once the canvas stops: `message.tool_calls`,
`reasoning_content` and the content left over; streamed, its pieces come as OpenAI deltas at the
end (plain), or on the last event beside the final snapshot (diffusing).

Stream events are built by `Responder.stream_formatter`, which the gateway hands to the scheduler:
it runs in the step worker thread (once per step per choice) and returns finished SSE bytes.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Optional

from celeris.engine.events import FinishReason, StepEvent
from celeris.engine.serving import CanvasDeltas, MASK_MARKER, Tokenizer
from celeris.server import tool_answers
from celeris.server.tool_answers import AnswerReader

FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.CANCELLED: "cancelled"}


def usage(ev: StepEvent) -> dict[str, Any]:
    gen = len(ev.generated)
    out = {"prompt_tokens": ev.prompt_tokens, "completion_tokens": gen, "total_tokens": ev.prompt_tokens + gen,
           "forward_passes": ev.forward_passes, "prompt_tokens_details": {"cached_tokens": ev.cached_tokens}}
    if ev.verify_passes:  # self-speculation: accepted tokens per verify pass = accepted_tokens / verify_passes
        out |= {"verify_passes": ev.verify_passes, "accepted_tokens": ev.accepted_tokens}
    return out


def _cached(usages: list[dict[str, Any]]) -> dict[str, int]:
    """OpenAI's prompt_tokens_details of summed usages: prompt tokens the prefix cache served."""
    return {"cached_tokens": sum(u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for u in usages)}


def seed_text(seed: int) -> str:
    """Seeds go out as decimal strings: they reach 2^63, and a JavaScript number (any JSON parser
    that reads doubles) keeps 53 bits, so a seed shown by a web page would not reproduce the run.
    Requests take a seed as a number or as such a string."""
    return str(seed)


def merge_finals(bodies: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """One response of several choices (prompts x n): their choices in order, usage summed
    (each prompt's tokens counted once, as OpenAI does for n > 1), `celeris` per choice."""
    if len(bodies) == 1:
        return bodies[0]
    body = dict(bodies[0])
    body["choices"] = [b["choices"][0] for b in bodies]
    prompt = sum(b["usage"]["prompt_tokens"] for b in bodies[::n])
    completion = sum(b["usage"]["completion_tokens"] for b in bodies)
    body["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                     "forward_passes": sum(b["usage"]["forward_passes"] for b in bodies),
                     "prompt_tokens_details": _cached([b["usage"] for b in bodies[::n]])}
    body["celeris"] = {"choices": [b["celeris"] for b in bodies]}
    return body


def usage_chunk(responders: list["Responder"], n: int) -> Optional[dict[str, Any]]:
    """OpenAI's `stream_options.include_usage` last chunk: empty `choices`, the usage of every
    choice summed (each prompt counted once); None if a choice never finished."""
    if not responders or any(r.usage is None for r in responders):
        return None
    first = responders[0]
    prompt = sum(r.usage["prompt_tokens"] for r in responders[::n])
    completion = sum(r.usage["completion_tokens"] for r in responders)
    body = first._envelope([], chunk=True)
    body["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                     "forward_passes": sum(r.usage["forward_passes"] for r in responders),
                     "prompt_tokens_details": _cached([r.usage for r in responders[::n]])}
    return body


def sse(data: Any) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


class Responder:
    """Builds the bodies of one request: ids, model name and creation time are shared by all."""

    def __init__(self, chat: bool, request_id: str, model: str, tok: Tokenizer, stops: tuple[str, ...] = (),
                 index: int = 0, echo: str = "", provisional: bool = False, reader: Optional[AnswerReader] = None):
        self.chat, self.model, self.tok, self.request_id = chat, model, tok, request_id
        # Chat answers read by parsers (tools, reasoning): their standard fields come whole at the end.
        self.reader = reader if chat and reader is not None and (reader.tool or reader.reasoning) else None
        self.usage: Optional[dict[str, Any]] = None  # set with the last chunk (stream_options.include_usage)
        self.provisional = provisional  # delta diffusing events carry the block's predictions
        self.index, self.echo = index, echo  # the choice this responder builds; completions' echoed prompt
        # Plain streaming holds back this many trailing characters until the end: a stop string
        # may span two blocks, and text already sent cannot be taken back.
        self.hold = max((len(x) for x in stops), default=1) - 1
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())
        self.sent = ""  # text already streamed in plain mode
        self.first = True
        self.deltas: Optional[CanvasDeltas] = None  # delta diffusing: the engine's canvas deltas
        self.layout_sent = False

    def _envelope(self, choices: list[dict], chunk: bool) -> dict[str, Any]:
        obj = "chat.completion" + (".chunk" if chunk else "") if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _choice(self, text: str, finish: Optional[str], chunk: bool, logprobs: Optional[dict] = None) -> dict[str, Any]:
        if not self.chat:
            return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if not chunk:
            return {"index": self.index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": finish}
        delta: dict[str, Any] = {"content": text}
        if self.first:
            delta["role"] = "assistant"
            self.first = False
        return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def logprobs(self, ev: StepEvent) -> Optional[dict]:
        """OpenAI's logprobs object for the generated tokens (each taken at its commit step)."""
        if not ev.logprobs:
            return None
        texts = [self.tok.token_text(t) for t in ev.generated]
        if self.chat:
            def entry(token: str, lp: float) -> dict:
                return {"token": token, "logprob": lp, "bytes": list(token.encode())}
            return {"content": [entry(t, lp) | {"top_logprobs": [entry(self.tok.token_text(i), v) for i, v in top]}
                                for t, (lp, top) in zip(texts, ev.logprobs)]}
        offsets, at = [], 0
        for t in texts:
            offsets.append(at)
            at += len(t)
        return {"tokens": texts, "token_logprobs": [lp for lp, _ in ev.logprobs],
                "top_logprobs": [{self.tok.token_text(i): v for i, v in top} for _, top in ev.logprobs],
                "text_offset": offsets}

    def final(self, ev: StepEvent) -> dict[str, Any]:
        """The non-streaming response."""
        text = self.echo + self.tok.decode_cut(ev.generated, ev.stop_text)
        choice = self._choice(text, self._finish(ev), chunk=False, logprobs=self.logprobs(ev))
        if self.reader is not None:  # reasoning split out, tool calls parsed
            answer = self._answer(ev)
            choice |= {"message": tool_answers.message(answer, self.reader),
                       "finish_reason": tool_answers.finish_reason(answer, choice["finish_reason"])}
        if ev.choice_probabilities is not None:  # typed decisions: a choice asked with logprobs
            choice["choice_probabilities"] = ev.choice_probabilities
        body = self._envelope([choice], chunk=False)
        return body | {"usage": usage(ev), "celeris": {"seed": seed_text(ev.seed), "steps": ev.steps,
                                                      "kv_cache": ev.kv_cache}}

    def _answer(self, ev: StepEvent) -> tool_answers.Answer:
        """The finished answer read by the parsers: its text with the chat format's markers kept
        (a tool-call or channel marker may be a special token), cut where a stop string begins."""
        return self.reader.read(tool_answers.answer_text(self.tok, ev.generated, ev.stop_text), self.request_id,
                                self.index)

    def answer_chunks(self, ev: StepEvent) -> Optional[list[dict[str, Any]]]:
        """Plain streaming of a parsed answer: nothing until the canvas stops (the answer is read
        whole), then its reasoning, content and tool calls as OpenAI deltas, and a last chunk with
        the finish reason, logprobs and usage."""
        if not ev.finished:
            return None
        answer = self._answer(ev)
        out = []
        for delta in tool_answers.deltas(answer):
            if self.first:
                delta, self.first = {"role": "assistant", **delta}, False
            out.append(self._envelope([{"index": self.index, "delta": delta, "logprobs": None, "finish_reason": None}],
                                      chunk=True))
        last = self._chunk("", ev)
        last["choices"][0]["finish_reason"] = tool_answers.finish_reason(answer, last["choices"][0]["finish_reason"])
        return out + [last]

    def _finish(self, ev: StepEvent) -> Optional[str]:
        return FINISH[ev.finish_reason or FinishReason.LENGTH] if ev.finished else None

    def _chunk(self, text: str, ev: StepEvent, extra: Optional[dict] = None) -> dict[str, Any]:
        lp = self.logprobs(ev) if ev.finished else None  # all of them, with the last chunk
        body = self._envelope([self._choice(text, self._finish(ev), chunk=True, logprobs=lp)], chunk=True)
        if ev.finished and ev.choice_probabilities is not None:  # typed decisions, with the last chunk
            body["choices"][0]["choice_probabilities"] = ev.choice_probabilities
        if extra:
            body["celeris"] = extra
        if ev.finished:
            body["usage"] = self.usage = usage(ev)
        return body

    def plain_chunk(self, ev: StepEvent) -> Optional[dict[str, Any]]:
        """The next append-only delta, or None when nothing new is final yet."""
        if not (ev.block_complete or ev.finished):
            return None
        if ev.finished:
            text = self.echo + self.tok.decode_cut(ev.generated, ev.stop_text)
        else:
            text = self.echo + self.tok.decode(ev.generated[:ev.settled])
            text = text[:len(text) - self.hold] if self.hold else text
        # A prefix can decode differently once more bytes follow (a split UTF-8 character): hold it back.
        if not text.startswith(self.sent) or (text.endswith("\ufffd") and not ev.finished):
            return self._chunk("", ev) if ev.finished else None
        delta, self.sent = text[len(self.sent):], text
        return self._chunk(delta, ev) if delta or ev.finished else None

    def diffusing_chunk(self, ev: StepEvent) -> dict[str, Any]:
        """A full snapshot of the canvas (replace, not append)."""
        mask, new, first_stop = self.tok.mask_id, set(ev.committed), ev.visible
        cells = [{"text": self.tok.token_text(t), "new": i in new,
                  "state": "masked" if t == mask else "stop" if i >= first_stop else "token",
                  "final": ev.is_final(i, mask)}
                 for i, t in enumerate(ev.canvas)]
        text = self.echo + (self.tok.decode_cut(ev.generated, ev.stop_text) if ev.finished
                            else self.tok.render(ev.canvas[:first_stop]))
        extra = {"replace": True, "step": ev.step + 1, "total_steps": ev.total_steps, "block": ev.block,
                 "num_blocks": ev.num_blocks, "masked": sum(c["state"] == "masked" for c in cells),
                 "committed": len(new), "done": ev.finished, "final_positions": ev.settled, "tokens": cells}
        if ev.finished:
            extra |= {"seed": seed_text(ev.seed), "kv_cache": ev.kv_cache}
        if ev.finished and self.reader is not None:  # the last event: the answer's standard fields, read
            answer = self._answer(ev)
            chunk = self._chunk(answer.content or "", ev, extra)
            delta = chunk["choices"][0]["delta"]
            if answer.reasoning is not None:
                delta["reasoning_content"] = answer.reasoning
            if answer.calls:
                delta["tool_calls"] = [{"index": k, **c.openai()} for k, c in enumerate(answer.calls)]
            choice = chunk["choices"][0]
            choice["finish_reason"] = tool_answers.finish_reason(answer, choice["finish_reason"])
            return chunk
        return self._chunk(text, ev, extra)

    def diffusing_delta(self, ev: StepEvent) -> dict[str, Any]:
        """The cells that changed since the previous event (the last event: a whole snapshot)."""
        if self.deltas is None:
            self.deltas = CanvasDeltas(self.tok, len(ev.canvas))
        d = self.deltas.delta(ev, dict(zip(ev.committed, ev.confidences)))
        if d is None:  # the last event
            chunk = self.diffusing_chunk(ev)
            chunk["celeris"]["format"] = "delta"
            return self._with_layout(chunk, ev)
        updates = []
        for c in d.cells:
            cell: dict[str, Any] = {"i": c.position, "text": c.text, "masked": c.masked, "final": c.final}
            if c.piece is not None:
                cell["piece"] = c.piece
            updates.append(cell)
        extra = {"format": "delta", "step": ev.step + 1, "total_steps": ev.total_steps, "block": ev.block,
                 "num_blocks": ev.num_blocks, "masked": d.masked, "committed": len(d.committed), "done": False,
                 "new": list(d.committed), "visible": d.visible, "final_positions": d.settled, "updates": updates}
        if self.provisional:
            extra["provisional"] = [{"i": g.position, "text": g.text, "confidence": g.confidence}
                                    for g in d.provisional]
        return self._with_layout(self._chunk("", ev, extra), ev)

    def _with_layout(self, chunk: dict[str, Any], ev: StepEvent) -> dict[str, Any]:
        if not self.layout_sent:
            self.layout_sent = True
            chunk["celeris"]["layout"] = {"gen_length": len(ev.canvas), "num_blocks": ev.num_blocks,
                                          "prompt_tokens": ev.prompt_tokens, "mask_text": MASK_MARKER,
                                          "echo": self.echo, "revising": ev.revising}
        return chunk

    def stream_formatter(self, diffusing: str = "", encode: Optional[Callable[[dict, StepEvent], bytes]] = None
                         ) -> Callable[[StepEvent], Optional[bytes]]:
        """The event -> SSE bytes function for one choice ("" plain, "delta" or "full" diffusing),
        run by the step worker so the event loop only writes bytes. `encode` turns each chunk into
        another API's events (server/http/api_shapes.py); by default a chunk is one `data:` event."""
        plain = self.answer_chunks if self.reader is not None else self.plain_chunk
        build = {"": plain, "full": self.diffusing_chunk, "delta": self.diffusing_delta}[diffusing]
        write = encode or (lambda chunk, ev: sse(chunk))

        def fmt(ev: StepEvent) -> Optional[bytes]:
            chunk = build(ev)
            if isinstance(chunk, list):  # several chunks from one event: one write
                return b"".join(write(c, ev) for c in chunk)
            return None if chunk is None else write(chunk, ev)
        return fmt
