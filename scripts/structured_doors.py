"""The doors of scripts/bench_structured.py's validity sweep: the same constrained requests through
the engine's offline API, over gRPC with the Python client (`celeris_client`), and over HTTP with
the official `openai` SDK against the OpenAI-compatible gateway. gRPC and HTTP go to one real
server started in this process on free ports (both doors of one `CelerisServer`, over an LLM
loaded from the model's folder like `celeris serve --model FOLDER` does).

Every door sends the same request: prompt "Answer:", temperature 1, the job's seed, 128 tokens,
steps 128, block 32; gRPC and HTTP send 16 requests at a time. HTTP sends a JSON schema the
OpenAI way (chat, `response_format` json_schema strict; the prompt is the user message, so it goes
through the chat template) and a regex/choice the vLLM way (completions, `structured_outputs`).
A driver returns, per job in order, the output text or the exception the request raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Callable, Iterator, Union

import openai

from celeris.engine.llm import LLM
from celeris.engine.requests import Request
from celeris.engine.structured.constraint import Structured
from celeris.server.app import create_server
from celeris.server.settings import ServerSettings
from celeris_client import CelerisClient

DOORS = ("engine", "grpc", "http")
PROMPT = "Answer:"
GEN_LENGTH, STEPS, BLOCK, TEMPERATURE = 128, 128, 32, 1.0
CONCURRENCY = 16
Job = tuple[str, Any, int]  # kind ("json_schema", "regex" or "choice"), the schema/regex/choices, seed
Outcome = Union[str, Exception]  # the output text, or what the request raised


def engine_door(llm: LLM, jobs: list[Job]) -> list[Outcome]:
    """The engine's offline API, in batches of CONCURRENCY."""
    base = replace(llm.defaults, gen_length=GEN_LENGTH, steps=STEPS, block_length=BLOCK, temperature=TEMPERATURE)
    out: list[Outcome] = []
    for i in range(0, len(jobs), CONCURRENCY):
        reqs = [Request(prompt=PROMPT, params=replace(base, seed=seed), structured=Structured(kind, value))
                for kind, value, seed in jobs[i:i + CONCURRENCY]]
        out += [r.text for r in llm.run([llm.build(q) for q in reqs])]
    return out


def concurrently(fn: Callable[[Job], str], jobs: list[Job]) -> list[Outcome]:
    """fn over the jobs, CONCURRENCY at a time on threads; an exception is kept as the outcome."""
    def one(job: Job) -> Outcome:
        try:
            return fn(job)
        except Exception as e:  # a refused or failed request is an invalid output, reported as such
            return e
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        return list(pool.map(one, jobs))


def grpc_door(target: str, jobs: list[Job]) -> list[Outcome]:
    """`CelerisClient.generate(prompt, structured_output=...)`, one client shared by the threads."""
    with CelerisClient(target, timeout=1800) as client:
        return concurrently(lambda job: client.generate(
            PROMPT, gen_length=GEN_LENGTH, steps=STEPS, block_length=BLOCK, temperature=TEMPERATURE,
            seed=job[2], structured_output={job[0]: job[1]}).text, jobs)


def http_door(base_url: str, jobs: list[Job]) -> list[Outcome]:
    """The official openai SDK: chat + response_format for schemas, completions + vLLM's
    structured_outputs for regexes and choices; the diffusion knobs ride in extra_body."""
    sdk = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=1800)
    model = sdk.models.list().data[0].id
    knobs = {"steps": STEPS, "block_length": BLOCK}

    def one(job: Job) -> str:
        kind, value, seed = job
        common = dict(model=model, max_tokens=GEN_LENGTH, temperature=TEMPERATURE, seed=seed)
        if kind == "json_schema":
            rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": value, "strict": True}}
            r = sdk.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], response_format=rf,
                                            extra_body=knobs, **common)
            return r.choices[0].message.content
        r = sdk.completions.create(prompt=PROMPT, extra_body=knobs | {"structured_outputs": {kind: value}}, **common)
        return r.choices[0].text
    with sdk:
        return concurrently(one, jobs)


@contextlib.contextmanager
def in_process_server(llm: LLM) -> Iterator[tuple[str, str]]:
    """A CelerisServer over `llm` on free gRPC and HTTP ports, its event loop on a thread of its own
    (the blocking clients run on this one); yields (gRPC target, HTTP base URL)."""
    settings = ServerSettings(host="127.0.0.1", port=0, http_port=0, drain_seconds=0, grace_seconds=2,
                              warmup=False)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="celeris-bench-server", daemon=True)
    thread.start()
    server, port = asyncio.run_coroutine_threadsafe(create_server(llm, settings), loop).result(120)
    try:
        yield f"127.0.0.1:{port}", f"http://127.0.0.1:{server.http.port}"
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0, 2), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def through_doors(load: Callable[[], LLM], doors: list[str],
                  jobs: list[Job]) -> Iterator[tuple[str, list[Outcome], float]]:
    """(door, outcomes, seconds) for each door asked, in DOORS order. `load` gives a fresh LLM: one
    for the engine door, another for the server, which serves gRPC and HTTP (its load, start and
    stop are not in the seconds). Fresh, so the server starts from a just-loaded engine: buffers an
    LLM made under inference_mode (the engine door runs there) cannot be written by the server's
    step thread, which runs outside it ("Inplace update to inference tensor outside InferenceMode")."""
    def timed(door: str, drive: Callable[[], list[Outcome]]) -> tuple[str, list[Outcome], float]:
        t0 = time.perf_counter()
        return door, drive(), time.perf_counter() - t0
    if "engine" in doors:
        llm = load()
        yield timed("engine", lambda: engine_door(llm, jobs))
        del llm
    if "grpc" in doors or "http" in doors:
        with in_process_server(load()) as (target, url):
            if "grpc" in doors:
                yield timed("grpc", lambda: grpc_door(target, jobs))
            if "http" in doors:
                yield timed("http", lambda: http_door(url, jobs))
