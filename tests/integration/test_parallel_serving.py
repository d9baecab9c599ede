"""`celeris serve --tensor-parallel-size 2` as a real process (#32): over gRPC it decodes what one
process decodes, and a worker killed mid-stream ends every stream with UNAVAILABLE and the
server exits with one error line naming the rank."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from pathlib import Path

import grpc
import pytest

from celeris.v1 import generation_pb2 as pb
from celeris.v1 import generation_pb2_grpc as pb_grpc
from celeris.engine.config import EngineConfig
from celeris.engine.llm import LLM
from celeris.engine.sampling.params import SamplingParams

pytestmark = pytest.mark.slow
PROMPTS = ["It is a truth universally", "1 + 2 ="]


def _workers(pid: int) -> list[int]:
    """The server's spawned tensor-parallel workers (not multiprocessing's resource tracker)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"spawn_main" in cmd:
                out.append(int(child))
    return out


def test_grpc_tp2_decodes_what_one_process_decodes(spawn, tiny_model_dir):
    proc = spawn("--tensor-parallel-size", "2")
    assert len(_workers(proc.proc.pid)) == 1
    offline = LLM.load(tiny_model_dir, EngineConfig(max_prompt_tokens=64, max_gen_length=64))
    with grpc.insecure_channel(proc.target) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        for i, prompt in enumerate(PROMPTS):
            req = pb.GenerateRequest(prompt=prompt, gen_length=16, steps=8, block_length=8, seed=3 + i,
                                     temperature=0.7 * i)
            last = list(stub.Generate(req, timeout=120))[-1]
            want = offline.generate_one(prompt, SamplingParams(gen_length=16, steps=8, block_length=8, seed=3 + i,
                                                               temperature=0.7 * i))
            assert last.done and last.text == want.text
            assert [t.id for t in last.tokens][:len(want.token_ids)] == want.token_ids


def test_a_worker_killed_mid_stream_ends_every_stream_unavailable(spawn):
    proc = spawn("--tensor-parallel-size", "2", "--grace-seconds", "20")
    (worker,) = _workers(proc.proc.pid)
    codes, started = [], threading.Barrier(4, timeout=120)

    def stream(seed: int) -> None:
        with grpc.insecure_channel(proc.target) as ch:
            req = pb.GenerateRequest(prompt="It is a truth universally", gen_length=512, steps=512,
                                     block_length=32, seed=seed)
            call = pb_grpc.GenerationServiceStub(ch).Generate(req, timeout=300)
            try:
                for i, _ in enumerate(call):
                    if i == 0:
                        started.wait()
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())

    threads = [threading.Thread(target=stream, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    started.wait()  # every stream has its first message
    os.kill(worker, signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert codes == [grpc.StatusCode.UNAVAILABLE] * 3
    assert proc.wait(timeout=120) == 1  # a hang would fail here, not pass
    lines = [json.loads(x) for x in proc.log_path.read_text().splitlines() if x.startswith("{")]
    lost = [r for r in lines if r.get("event") == "server.worker_lost"]
    assert len(lost) == 1 and "rank 1" in lost[0]["error"], proc.log_tail()
    assert [r for r in lines if r.get("level") == "error"] == lost  # one error line


def test_a_hung_worker_is_named_after_the_collective_timeout(spawn):
    proc = spawn("--tensor-parallel-size", "2", "--collective-timeout", "3", "--grace-seconds", "20")
    (worker,) = _workers(proc.proc.pid)
    os.kill(worker, signal.SIGSTOP)  # alive, but never joins another collective
    try:
        with grpc.insecure_channel(proc.target) as ch:
            req = pb.GenerateRequest(prompt="1 + 2 =", gen_length=16, steps=8, block_length=8, seed=1)
            with pytest.raises(grpc.RpcError) as err:
                list(pb_grpc.GenerationServiceStub(ch).Generate(req, timeout=120))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert proc.wait(timeout=120) == 1
    finally:  # the server kills it on the way out; make sure
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)
    lines = [json.loads(x) for x in proc.log_path.read_text().splitlines() if x.startswith("{")]
    lost = [r for r in lines if r.get("event") == "server.worker_lost"]
    assert len(lost) == 1 and "rank 1 did not answer" in lost[0]["error"], proc.log_tail()


def test_run_and_bench_in_process_take_the_flag(tiny_model_dir, tmp_path, capsys):
    from celeris.server.cli import main as celeris

    run = ["run", "--model", str(tiny_model_dir), "--prompt", "It is a truth", "--gen-length", "16",
           "--steps", "8", "--block-length", "8", "--seed", "4", "--json"]
    assert celeris(run) == 0
    one = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert celeris(run + ["--tensor-parallel-size", "2"]) == 0
    two = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert two["token_ids"] == one["token_ids"]
    report = tmp_path / "bench.json"
    assert celeris(["bench", "--in-process", "--model", str(tiny_model_dir), "--tensor-parallel-size", "2",
                    "--concurrency", "2", "--requests", "2", "--prompt-len", "8", "--gen-length", "16", "--steps",
                    "8", "--block-length", "8", "--report", str(report), "--quiet"]) == 0
    assert json.loads(report.read_text())["results"]["ok"] == 2
