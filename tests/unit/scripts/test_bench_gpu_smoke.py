"""scripts/bench_gpu.py's smoke mode (tiny shapes, CPU) runs every phase and writes the report
the device run writes: conditions, rows, skipped, and a `targets` object of issue 28."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"


def run(tmp_path: Path, *args: str) -> dict:
    sys.path.insert(0, str(SCRIPTS))
    try:
        import bench_gpu
        out = tmp_path / "bench.json"
        assert bench_gpu.main(["--smoke", "--json", str(out), *args]) == 0
        return json.loads(out.read_text())
    finally:
        sys.path.remove(str(SCRIPTS))


@pytest.mark.slow
def test_step_phase_smoke_report(tmp_path):
    report = run(tmp_path, "--phases", "step", "--models", "sdar,llada2")
    cond = report["conditions"]
    for key in ("device", "torch", "cuda", "dtype", "prompt_len", "gen_length", "shapes", "commit",
                "graph_max_tokens"):
        assert key in cond
    rows = report["rows"]
    assert {r["model"] for r in rows} == {"tiny-sdar-random", "tiny-llada2-random"}
    assert all(r["median_step_ms"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert {(r["batch"], r["graphs_setting"]) for r in rows} == {(1, False), (1, True), (8, False), (8, True)}
    assert all(r["cuda_graphs"] == r["graphs_setting"] and (r["graphs_captured"] > 0) == r["graphs_setting"]
               for r in rows)  # the graph path, rehearsed eagerly on the CPU
    assert set(report["graph_crossover"]) == {"tiny-sdar-random/exact", "tiny-llada2-random/exact"}
    for t in report["targets"].values():
        assert set(t) == {"measured", "goal", "met"} and isinstance(t["met"], bool)


@pytest.mark.slow
def test_every_phase_smoke_report_with_a_served_row(tmp_path):
    report = run(tmp_path)
    served = [r for r in report["rows"] if r["phase"] == "served"]
    assert len(served) == 1 and served[0]["failed"] == 0 and served[0]["served_tokens_per_s"] > 0
    assert {r["cache"] for r in report["rows"] if r["phase"] == "step"} == {"exact", "dual", "prefix", "none"}
    assert report["targets"]["served_over_in_process"]["measured"] == served[0]["served_over_engine"]
