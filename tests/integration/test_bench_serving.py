"""scripts/bench_serving.py --quick end to end: a `celeris serve` process, a client process, the
engine beside them and the simulated GPU step. Structure and sanity only, never timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from celeris_client import stream_load

ROOT = Path(__file__).resolve().parents[2]


def test_stream_modes_pick_up_delta_once_the_protos_have_it(monkeypatch):
    assert [n for n, _ in stream_load.stream_modes()][:3] in (["full", "block", "final"], ["delta", "full", "block"])
    monkeypatch.setattr(stream_load.pb, "SNAPSHOT_FORMAT_DELTA", 2, raising=False)
    names = [n for n, _ in stream_load.stream_modes()]
    assert names[0] == "delta" and {"full", "block", "final", "block-delta"} <= set(names)
    opts = stream_load.MODES["delta-provisional"]()
    assert opts.provisional and opts.format == stream_load.pb.SNAPSHOT_FORMAT_DELTA


@pytest.mark.slow  # a server process, a client process and the engine, end to end
def test_quick_benchmark_reports_every_cell_and_the_targets(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "scripts/bench_serving.py", "--quick", "--threads", "1", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "targets:" in proc.stdout and "repeat 1/1" in proc.stdout  # the table and progress lines
    report = json.loads(out.read_text())
    c = report["conditions"]
    assert c["threads"] == 1 and c["model"] == "celeris-tiny" and c["commit"]
    modes = c["modes"]
    assert {"full", "block", "final"} <= set(modes) and "delta-provisional" not in modes  # opt-in only
    assert sorted(report["cells"]) == ["16/1", "16/4"]
    for cell in report["cells"].values():
        rows = cell["modes"]
        assert set(rows) == {"engine", "scheduler", *modes}
        assert rows["engine"]["tokens"] > 0
        for m in modes:
            r = rows[m]
            assert r["failed"] == 0 and r["tokens"] == rows["engine"]["tokens"]  # same work, same seeds
            assert r["steps"] > 0 and r["forward_ms"] > 0 and r["cpu_ms"] > 0 and r["loop_cpu_ms"] > 0
            assert r["latency_p95_ms"] >= r["latency_p50_ms"] >= r["first_p50_ms"] > 0
        blocks = cell["gen_length"] // cell["block_length"]
        # One message per step (threshold: <= steps) or per finished block; a request that ends
        # with EOS stops early, so fewer blocks than the canvas holds may be sent.
        assert 1 <= rows["block"]["messages_per_request"] <= blocks
        assert rows["block"]["messages_per_request"] < rows["full"]["messages_per_request"] <= cell["steps"]
        assert rows["final"]["messages_per_request"] == 1
        assert rows["full"]["bytes_per_request"] > rows["block"]["bytes_per_request"] > rows["final"]["bytes_per_request"]
    sim = report["simulation"]
    assert sim["server"]["failed"] == 0 and sim["server"]["messages_per_request"] == sim["gen_length"]
    assert sim["runner_steps_per_s"] > 0 and 0 < sim["ratio"] < 2
    assert sim["server"]["forward_ms"] >= sim["step_ms"] * 0.99  # the sleep is the forward
    assert set(report["targets"]) == {"a_grpc_over_scheduler_gen16", "a_grpc_over_engine_gen16",
                                      "b_sim_server_over_runner", "c_delta_over_full_bytes"}
    for cell in report["cells"].values():  # the in-process scheduler ran the same requests
        sched, engine = cell["modes"]["scheduler"], cell["modes"]["engine"]
        assert sched["tokens"] == engine["tokens"] and sched["steps"] > 0 and sched["forwards_per_step"] >= 1
