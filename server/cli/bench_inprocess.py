"""The engine side of `celeris bench --in-process`: the same load, with no transport in the way.

`clients/bench.py` owns the load pattern, the timing and the report but must not import the
engine (DESIGN.md: clients never import engine or server, never pull in torch). So the `celeris`
dispatcher (server/cli/entry.py, the one module that sees both sides) passes `InProcessBackend` to
`celeris_client.cli.main` when `--in-process` is given. The backend loads the model, runs its engine
(engine/serving.py) in this process and submits requests directly: figures without gRPC, protobuf or network, to set
beside a server bench on the same machine. `--model` is resolved as `celeris serve` resolves it
(server/cli/model.py): a folder, an embedded model's name or a Hugging Face id (`--revision`,
`--download-dir`), with `--device` checked and `--dtype auto` read from the checkpoint first.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from typing import Any, Callable, Optional

from celeris.engine.requests import Request
from celeris.engine.serving import LLM, Engine, EngineConfig

FILLER = "The quick brown fox jumps over the lazy dog while the sea rolls in under a grey sky. "


class InProcessBackend:
    """Implements clients.bench.BenchBackend over an engine in this process."""

    def __init__(self, a: argparse.Namespace):
        from celeris.server.cli.model import model_from_args

        self.args = a
        self.source = model_from_args(a)  # one line (EngineError) for a bad device or model, before loading
        self.llm: Optional[LLM] = None
        self.engine: Optional[Engine] = None
        self.thread = None  # the TensorThread the model is loaded and stepped on

    async def open(self) -> dict[str, Any]:
        import torch

        from celeris.engine.serving import TensorThread, configure_threads

        a = self.args
        configure_threads(a.threads)  # default: the CPUs this process may use (affinity, cgroup quota)
        gen = a.gen_length or 0
        cfg = EngineConfig(device=a.device, dtype=a.dtype, max_batch=a.max_batch or a.concurrency,
                           max_queue=max(64, a.requests + a.warmup), max_gen_length=max(512, gen),
                           max_prompt_tokens=max(512, a.prompt_len),
                           tensor_parallel_size=a.tensor_parallel_size, expert_parallel=a.expert_parallel)
        # Loaded on the thread that will step it, as `celeris serve` does (engine/threads.py).
        self.thread = TensorThread()
        self.llm = await asyncio.wrap_future(self.thread.submit(LLM.load, self.source.path, cfg))
        self.engine = Engine(self.llm, thread=self.thread)
        self.engine.start()
        d = self.llm.defaults
        return {"server": "in-process", "model": self.source.repo_id or self.llm.name, "architecture": self.llm.model_config.arch,
                "parameters": self.llm.parameter_count, "dtype": cfg.dtype, "device": cfg.device,
                "threads": torch.get_num_threads(), "max_batch": cfg.max_batch,
                "defaults": {"gen_length": d.gen_length, "steps": d.steps, "block_length": d.block_length,
                             "temperature": d.temperature, "remasking": d.remasking,
                             "frequency_penalty": d.frequency_penalty, "presence_penalty": d.presence_penalty}}

    async def prompt_ids(self, n: int) -> list[int]:
        chunk = self.llm.tokenizer.encode(FILLER * 8)
        return (chunk * (n // max(1, len(chunk)) + 1))[:n]

    async def run(self, prompt_ids: list[int], knobs: dict[str, Any], first: Callable[[], None]) -> tuple[int, int]:
        params = dataclasses.replace(self.llm.defaults, **knobs)
        prepared = self.engine.prepare_now(Request(token_ids=prompt_ids, params=params))
        last = None
        with self.engine.submit([prepared])[0] as stream:
            async for last in stream:
                first()
        return (len(last.generated), last.forward_passes) if last is not None else (0, 0)

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.stop()
        if self.llm is not None:
            self.llm.close()  # tensor-parallel workers, if any
        if self.thread is not None:
            self.thread.close()
