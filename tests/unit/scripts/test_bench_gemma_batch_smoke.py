"""scripts/bench_gemma_batch.py on its tiny shape: the report docs/benchmarks.md quotes (conditions, CPU
and wall medians of the three setups, their ratios to one row); the script itself asserts each step's
forwards (one shared, or one a row)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"


def test_tiny_report_has_every_setup(tmp_path):
    threads = torch.get_num_threads()
    sys.path.insert(0, str(SCRIPTS))
    try:
        import bench_gemma_batch
        out = tmp_path / "batch.json"
        assert bench_gemma_batch.main(["--shapes", "tiny", "--repeats", "1", "--json", str(out)]) == 0
    finally:
        sys.path.remove(str(SCRIPTS))
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    assert report["dtype"] == "float32" and "torch threads" in report["machine"]
    (row,) = report["results"]
    setups = {"1 row", "8 rows, one forward", "8 rows, a forward each"}
    assert set(row["cpu_ms"]) == set(row["wall_ms"]) == setups
    assert all(v > 0 for v in row["cpu_ms"].values())
    assert set(row["8_vs_1_cpu"]) == setups - {"1 row"}
