"""scripts/bench_nemotron.py on a tiny shape: one row per mode with the counts docs/benchmarks.md
quotes (tokens per forward, diffusion's denoise steps per block, linear_spec's accepted tokens per
verify pass), each within what its loop can do."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"


def test_tiny_report_has_every_mode(capsys):
    threads = torch.get_num_threads()
    sys.path.insert(0, str(SCRIPTS))
    try:
        import bench_nemotron
        assert bench_nemotron.main(["--batch", "2", "--gen", "16", "--block", "4", "--threads", "1"]) == 0
    finally:
        sys.path.remove(str(SCRIPTS))
        torch.set_num_threads(threads)
    report = json.loads(capsys.readouterr().out)
    rows = {r["mode"]: r for r in report["rows"]}
    assert set(rows) == {"ar", "diffusion", "linear_spec"} and report["conditions"]["block_length"] == 4
    assert rows["ar"]["tokens_per_forward"] <= 1  # one token a forward (the prefill's counts once)
    assert 1 <= rows["diffusion"]["denoise_steps_per_block"] <= 3  # b - 1 masks, at least one a step
    assert 1 <= rows["linear_spec"]["accepted_per_verify"] <= 4
