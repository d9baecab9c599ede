"""`celeris batch in.jsonl out.jsonl`: one generation per input line, resumable.

Input lines are JSON objects: {"id": ..., "prompt": "..."} (or "messages": [...], or
"token_ids": [...]) plus any generation knob (gen_length, steps, block_length, temperature,
remasking, threshold, factor, cfg_scale, seed) and an optional "metadata" value echoed to the
output. A "messages" line may carry "tools", "tool_choice" and "parallel_tool_calls" as chat
completions take them (OpenAI's shapes; docs/tools.md). A line that is not valid is reported on
stderr and skipped; the batch goes on.

Output lines are written as items finish (any order): {"id", "status": "ok", "text",
"finish_reason", "usage", "seed", "steps", "latency_s", ...; with tools also "tool_calls" in
OpenAI's shape and "content", the text left beside them} or {"id", "status": "error",
"error": {"code", "message", "field_violations"}, "latency_s"}. Rerunning skips the ids that
already have an "ok" line, so an interrupted batch resumes; failed items are tried again and the
last line for an id wins.

A server restart is ridden out: an item refused as UNAVAILABLE (connection refused, draining),
RESOURCE_EXHAUSTED or a peer's CANCELLED is tried again with jittered exponential backoff (never
sooner than the server's RetryInfo) for up to `retry_window_s` (default 60 s) before it is
written as failed. Each worker holds one item at a time, so these retries never add calls beyond
`concurrency` in flight; an item's line is written once, when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, TextIO

from celeris_client.client import AsyncCelerisClient
from celeris_client.errors import CelerisError, is_retryable
from celeris_client.progress import Progress, fmt_seconds, percentile
from celeris_client.types import KNOBS, Prompt, build_request

INPUT_KEYS = ("prompt", "messages", "token_ids")
TOOL_KEYS = ("tools", "tool_choice", "parallel_tool_calls")  # chat lines only, as chat completions take them
RETRY_WINDOW_S = 60.0  # how long one item keeps trying through a restart or a full server
FIRST_WAIT_S, MAX_WAIT_S = 0.5, 5.0  # its backoff: doubling from the first, capped
# The channel reconnects at least this often while the server is away (gRPC's own backoff grows
# to 120 s, so a 30 s restart could otherwise keep the batch waiting for a minute more).
RECONNECT_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                     ("grpc.max_reconnect_backoff_ms", 2000))


@dataclass(frozen=True)
class Item:
    id: str
    prompt: Prompt
    knobs: dict[str, Any]
    metadata: Any = None


@dataclass
class Summary:
    total: int = 0
    ok: int = 0
    failed: int = 0
    skipped: int = 0
    bad_lines: int = 0
    tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    def describe(self) -> str:
        rate = self.tokens / self.wall_s if self.wall_s > 0 else 0.0
        return (f"batch: {self.ok + self.failed} run ({self.ok} ok, {self.failed} failed), {self.skipped} skipped "
                f"(already done), {self.bad_lines} bad input lines · {fmt_seconds(self.wall_s)} · "
                f"{(self.ok + self.failed) / max(self.wall_s, 1e-9):.2f} items/s · {self.tokens} tokens · "
                f"{rate:.1f} tok/s · latency p50 {fmt_seconds(percentile(self.latencies, 50))} "
                f"p95 {fmt_seconds(percentile(self.latencies, 95))}")


def parse_line(line: str, defaults: dict[str, Any]) -> Item:
    """One input line -> Item; ValueError says what is wrong with it."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    unknown = set(obj) - {"id", "metadata", *INPUT_KEYS, *KNOBS, *TOOL_KEYS}
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}")
    inputs = [k for k in INPUT_KEYS if k in obj]
    if len(inputs) != 1:
        raise ValueError("needs exactly one of prompt, messages, token_ids")
    if not isinstance(obj.get("id", ""), (str, int)) or isinstance(obj.get("id"), bool):
        raise ValueError("id must be a string or an integer")
    if inputs[0] != "messages" and any(obj.get(k) is not None for k in TOOL_KEYS):
        raise ValueError("tools, tool_choice and parallel_tool_calls need \"messages\" (a chat)")
    knobs = defaults | {k: obj[k] for k in (*KNOBS, *TOOL_KEYS) if obj.get(k) is not None}
    prompt = obj[inputs[0]]
    try:
        build_request(prompt, **knobs)  # type and range checks a server would otherwise fail on
    except (TypeError, ValueError) as e:
        raise ValueError(str(e)) from None
    return Item(str(obj["id"]) if "id" in obj else "", prompt, knobs, obj.get("metadata"))


def read_items(path: Path, defaults: dict[str, Any], err: TextIO) -> tuple[list[Item], int]:
    """(items, number of bad lines); items without an id get "line-N"."""
    items, seen, bad = [], set(), 0
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = parse_line(line, defaults)
                if not item.id:
                    item = Item(f"line-{n}", item.prompt, item.knobs, item.metadata)
                if item.id in seen:
                    raise ValueError(f"duplicate id {item.id!r}")
            except ValueError as e:
                bad += 1
                print(f"{path}:{n}: skipped: {e}", file=err)
                continue
            seen.add(item.id)
            items.append(item)
    return items, bad


def to_stream(out_path: Path) -> bool:
    """`-`, or an existing path that is not a regular file (/dev/stdout on a pipe, a FIFO): written
    as a stream, with nothing to resume from."""
    return str(out_path) == "-" or (out_path.exists() and not out_path.is_file())


def set_aside_torn_line(out_path: Path, err: TextIO) -> None:
    """A run killed mid-write leaves a last line without its newline. Move it to OUT.torn and cut
    the output back to its last whole line, so every line of OUT parses and the item runs again."""
    with open(out_path, "rb+") as f:
        data = f.read()
        if not data or data.endswith(b"\n"):
            return
        keep = data.rfind(b"\n") + 1
        torn = out_path.with_name(out_path.name + ".torn")
        with open(torn, "ab") as aside:
            aside.write(data[keep:] + b"\n")
        f.truncate(keep)
    print(f"batch: {out_path}: its last line was cut off by an interrupted run ({len(data) - keep} bytes); "
          f"moved to {torn}", file=err)


@contextlib.contextmanager
def _open_output(out_path: Path) -> Iterator[TextIO]:
    if str(out_path) == "-":
        yield sys.stdout
        return
    if to_stream(out_path):
        with open(out_path, "w", encoding="utf-8") as out:
            yield out
        return
    with open(out_path, "a", encoding="utf-8") as out:  # a torn last line was set aside before
        yield out


def done_ids(out_path: Path) -> set[str]:
    """Ids with an "ok" line in a previous run's output (a torn last line is ignored)."""
    done: set[str] = set()
    if to_stream(out_path) or not out_path.exists():
        return done
    for line in out_path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and rec.get("status") == "ok":
            done.add(str(rec.get("id")))
    return done


def restart_wait(err: CelerisError, attempt: int, left_s: float) -> Optional[float]:
    """Seconds before trying an item again (attempt counts from 0), or None: not a restart or a
    full server, or the item's retry window is spent. Equal jitter, so workers spread out."""
    if not is_retryable(err):
        return None
    cap = min(MAX_WAIT_S, FIRST_WAIT_S * 2 ** attempt)
    wait = max(random.uniform(cap / 2, cap), err.retry_after or 0.0)
    return wait if wait < left_s else None


async def generate_through_restarts(client: AsyncCelerisClient, item: Item, timeout: Optional[float],
                                    retry_window_s: float) -> Any:
    """`client.generate` of one item, tried again while `restart_wait` allows."""
    give_up, attempt = time.monotonic() + retry_window_s, 0
    while True:
        try:
            return await client.generate(item.prompt, timeout=timeout, **item.knobs)
        except CelerisError as e:
            wait = restart_wait(e, attempt, give_up - time.monotonic())
            if wait is None:
                raise
        await asyncio.sleep(wait)
        attempt += 1


async def run_item(client: AsyncCelerisClient, item: Item, timeout: Optional[float],
                   retry_window_s: float = RETRY_WINDOW_S) -> dict[str, Any]:
    t0 = time.perf_counter()
    rec: dict[str, Any] = {"id": item.id}
    try:
        res = await generate_through_restarts(client, item, timeout, retry_window_s)
    except CelerisError as e:
        rec |= {"status": "error", "error": {"code": e.code.name, "message": e.message, "field_violations": [
            {"field": v.field, "description": v.description} for v in e.field_violations]}}
    else:
        rec |= {"status": "ok", "text": res.text, "finish_reason": res.finish_reason, "seed": res.seed,
                "steps": res.steps, "usage": {"prompt_tokens": res.usage.prompt_tokens,
                                              "generated_tokens": res.usage.generated_tokens,
                                              "forward_passes": res.usage.forward_passes},
                "request_id": res.request_id}
        if item.knobs.get("tools"):  # what the server read from the answer: its calls and the text beside them
            rec |= {"tool_calls": [c.openai() for c in res.tool_calls], "content": res.content}
    rec["latency_s"] = round(time.perf_counter() - t0, 4)
    if item.metadata is not None:
        rec["metadata"] = item.metadata
    return rec


async def run_batch(client: AsyncCelerisClient, in_path: Path, out_path: Path, *, concurrency: int = 4,
                    defaults: Optional[dict[str, Any]] = None, timeout: Optional[float] = None,
                    err: Optional[TextIO] = None, retry_window_s: float = RETRY_WINDOW_S) -> Summary:
    err = err or sys.stderr
    items, bad = read_items(in_path, defaults or {}, err)
    if not to_stream(out_path) and out_path.is_file():
        set_aside_torn_line(out_path, err)
    finished = done_ids(out_path)
    todo = [it for it in items if it.id not in finished]
    summary = Summary(total=len(items), skipped=len(items) - len(todo), bad_lines=bad)
    progress = Progress(len(todo), label="batch ", out=err)
    queue: asyncio.Queue[Item] = asyncio.Queue()
    for it in todo:
        queue.put_nowait(it)
    t0 = time.perf_counter()
    with _open_output(out_path) as out:

        async def worker() -> None:
            while not queue.empty():
                rec = await run_item(client, queue.get_nowait(), timeout, retry_window_s)
                out.write(json.dumps(rec, ensure_ascii=False) + "\n")
                out.flush()
                ok = rec["status"] == "ok"
                summary.ok += ok
                summary.failed += not ok
                summary.latencies.append(rec["latency_s"])
                summary.tokens += rec["usage"]["generated_tokens"] if ok else 0
                progress.update(ok)

        await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(todo) or 1)))))
    summary.wall_s = time.perf_counter() - t0
    progress.close()
    return summary
