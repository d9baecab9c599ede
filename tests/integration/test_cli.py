"""`celeris generate | batch | bench` against a real in-process server (and bench in-process)."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

from celeris_client import CelerisClient
from celeris.server.cli import main as celeris
from tests.integration.live_server import live_server

KNOBS = ["--gen-length", "16", "--steps", "8", "--block-length", "8", "--seed", "5"]


@pytest.fixture
def live(tiny_llm):
    with live_server(tiny_llm) as s:
        yield s


SERVER_LOG = re.compile(r"^\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d")  # the in-process server logs to stdout too


def _server_log(line: str) -> bool:
    if SERVER_LOG.match(line):
        return True
    try:  # JSON log lines, once a test has configured JSON logging
        obj = json.loads(line)
    except ValueError:
        return False
    return isinstance(obj, dict) and {"event", "level", "timestamp"} <= obj.keys()


def command_output(text: str) -> list[str]:
    return [line for line in text.splitlines() if not _server_log(line)]


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def reference(live, prompt: str = "Emma") -> str:
    with CelerisClient(live.grpc_target) as c:
        return c.generate(prompt, gen_length=16, steps=8, block_length=8, seed=5).text


def test_generate_plain_when_not_a_terminal(live, capsys):
    assert celeris(["generate", "--server", live.grpc_target, "Emma", *KNOBS]) == 0
    assert command_output(capsys.readouterr().out) == [reference(live)]


def test_generate_json_lines(live, capsys):
    assert celeris(["generate", "--server", live.grpc_target, "Emma", "--json", *KNOBS]) == 0
    lines = [json.loads(x) for x in command_output(capsys.readouterr().out)]
    assert len(lines) >= 2 and lines[-1]["done"] and not lines[0]["done"]
    assert lines[0]["tokens"][0].keys() >= {"id", "text", "masked", "committed_this_step"}
    assert lines[-1]["text"] == reference(live) and lines[-1]["usage"]["forward_passes"] == lines[-1]["step"]


def test_generate_json_lines_with_provisional_predictions(live, capsys):
    assert celeris(["generate", "--server", live.grpc_target, "Emma", "--json", "--provisional", *KNOBS]) == 0
    lines = [json.loads(x) for x in command_output(capsys.readouterr().out)]
    guesses = [(p, t) for line in lines for p, t in line["provisional"]]
    assert guesses and all(lines[0]["tokens"][p]["masked"] for p, _ in lines[0]["provisional"])
    assert {"id", "text", "confidence"} <= guesses[0][1].keys() and not lines[-1]["provisional"]
    assert lines[-1]["text"] == reference(live)  # predictions change nothing
    assert celeris(["generate", "--server", live.grpc_target, "Emma", "--plain", "--provisional"]) == 2
    assert "--provisional" in capsys.readouterr().err


def test_generate_live_view_on_a_terminal(live, monkeypatch):
    out = Tty()
    monkeypatch.setattr("sys.stdout", out)
    assert celeris(["generate", "--server", live.grpc_target, "Emma", *KNOBS]) == 0
    text = out.getvalue()
    assert "step 1/8 · block 1/2" in text and "\x1b[2;37m\u2592" in text  # dim masks
    assert "\x1b[1;30;43m" in text and "\x1b[J" in text  # highlighted new tokens, redrawn in place
    assert " tokens/forward " in text and text.endswith("\x1b[?25h")


def test_generate_reports_bad_fields(live, capsys):
    assert celeris(["generate", "--server", live.grpc_target, "Emma", "--gen-length", "12", "--block-length", "5"]) == 2
    err = capsys.readouterr().err
    assert "INVALID_ARGUMENT" in err and "block_length:" in err


def test_batch_resumes_and_skips_bad_lines(live, tmp_path, capsys):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [json.dumps({"id": f"q{i}", "prompt": f"Emma {i}", "seed": i}) for i in range(5)]
    lines += ["{not json", json.dumps({"id": "bad-knobs", "prompt": "x", "gen_length": 12, "block_length": 5})]
    src.write_text("\n".join(lines) + "\n")
    args = ["batch", str(src), str(dst), "--server", live.grpc_target, "--concurrency", "3", *KNOBS[:6]]
    assert celeris(args) == 1  # one bad line and one rejected item
    err = capsys.readouterr().err
    assert "in.jsonl:6: skipped: not valid JSON" in err and "batch: 6 run (5 ok, 1 failed)" in err
    recs = {r["id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    assert recs["q1"]["status"] == "ok" and recs["q1"]["seed"] == 1 and recs["q1"]["latency_s"] > 0
    assert recs["bad-knobs"]["status"] == "error" and recs["bad-knobs"]["error"]["code"] == "INVALID_ARGUMENT"
    assert {v["field"] for v in recs["bad-knobs"]["error"]["field_violations"]} >= {"block_length"}

    with dst.open("a") as f:
        f.write('{"id": "torn')  # a run killed mid-line
    celeris(args)
    err = capsys.readouterr().err
    assert "batch: 1 run (0 ok, 1 failed), 5 skipped" in err  # only the failed item ran again
    assert f"moved to {dst}.torn" in err  # said so
    tail = [json.loads(line) for line in dst.read_text().splitlines()]  # every line parses again
    assert tail[-1]["id"] == "bad-knobs" and Path(f"{dst}.torn").read_text() == '{"id": "torn\n'


def test_bench_against_a_server(live, tmp_path, capsys, tiny_llm):
    report = tmp_path / "bench.json"
    args = ["bench", "--server", live.grpc_target, "--concurrency", "3", "--requests", "6", "--prompt-len", "12",
            "--gen-length", "16", "--steps", "8", "--block-length", "8", "--threshold", "0.5", "--report", str(report)]
    assert celeris(args) == 0
    out = "\n".join(command_output(capsys.readouterr().out))
    assert "output tokens/s" in out and "first snapshot" in out and "tokens per forward" in out
    r = json.loads(report.read_text())
    c, res = r["conditions"], r["results"]
    assert c["model"] == tiny_llm.name and c["dtype"] == "float32" and c["concurrency"] == 3
    assert (c["prompt_tokens"], c["gen_length"], c["steps"], c["block_length"]) == (12, 16, 8, 8)
    assert c["decoder"]["threshold"] == 0.5 and c["decoder"]["remasking"] == "low_confidence"
    # The penalties the run used: here the served model's defaults (no flag sets them).
    assert c["decoder"]["frequency_penalty"] == tiny_llm.defaults.frequency_penalty
    assert c["decoder"]["presence_penalty"] == tiny_llm.defaults.presence_penalty
    assert c["machine"]["cpu_count"] >= 1 and c["max_batch"] == tiny_llm.config.max_batch
    assert res["ok"] == 6 and res["output_tokens_per_s"] > 0 and res["tokens_per_forward"] >= 1
    assert 0 < res["time_to_first_snapshot_s"]["p50"] <= res["latency_s"]["p50"] <= res["latency_s"]["p95"]


def test_bench_in_process(tiny_model_dir, tmp_path, capsys):
    report = tmp_path / "bench.json"
    args = ["bench", "--in-process", "--model", str(tiny_model_dir), "--concurrency", "2",
            "--requests", "4", "--prompt-len", "8", "--gen-length", "16", "--steps", "8", "--block-length", "8",
            "--frequency-penalty", "0.3", "--report", str(report), "--quiet"]
    assert celeris(args) == 0
    r = json.loads(report.read_text())
    assert r["conditions"]["server"] == "in-process" and r["conditions"]["threads"] >= 1
    assert r["conditions"]["decoder"]["frequency_penalty"] == 0.3  # the flag, not the model's default
    assert r["conditions"]["decoder"]["presence_penalty"] == 0.0
    assert r["conditions"]["max_batch"] == 2 and r["results"]["ok"] == 4


def test_bench_in_process_needs_the_dispatcher(capsys):
    from celeris_client.cli import main as client_main

    assert client_main(["bench", "--in-process"]) == 2
    assert "celeris" in capsys.readouterr().err


def _piped_into_head(argv: list[str]) -> tuple[int, str, str]:
    """Run `celeris ARGV | head -1` with real processes; (rc of celeris, first line, its stderr)."""
    import os
    import subprocess
    import sys

    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.Popen([sys.executable, "-m", "celeris.server.cli", *argv], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    first = p.stdout.readline().decode()
    p.stdout.close()  # the reader goes away, as head does after its line
    try:
        err = p.stderr.read().decode()
        rc = p.wait(timeout=60)
    finally:
        p.kill()
    return rc, first, err


def test_generate_json_into_a_closed_pipe_ends_quietly(live):
    rc, first, err = _piped_into_head(["generate", "--server", live.grpc_target, "Emma", "--json",
                                       "--gen-length", "64", "--steps", "64", "--block-length", "8"])
    assert json.loads(first)["step"] == 1
    assert rc == 0 and "Traceback" not in err and "Errno 32" not in err and "error" not in err, err


def test_batch_to_stdout_into_a_closed_pipe_ends_quietly(live, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Emma {i}"}) + "\n" for i in range(12)))
    rc, first, err = _piped_into_head(["batch", str(src), "-", "--server", live.grpc_target, "--concurrency", "1",
                                       *KNOBS[:6]])
    assert json.loads(first)["status"] == "ok"
    assert rc == 0 and "Traceback" not in err and "Errno 32" not in err, err


def test_batch_to_stdout_writes_every_line(live, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Emma {i}"}) + "\n" for i in range(3)))
    assert celeris(["batch", str(src), "-", "--server", live.grpc_target, *KNOBS[:6]]) == 0
    recs = [json.loads(x) for x in command_output(capsys.readouterr().out)]
    assert sorted(r["id"] for r in recs) == ["q0", "q1", "q2"] and {r["status"] for r in recs} == {"ok"}
