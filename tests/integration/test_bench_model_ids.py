"""`celeris bench --in-process` names its model as `celeris serve` does (issue 45): a Hugging Face
id through the Hugging Face cache (offline here, the cache laid out as huggingface_hub lays it
out), reported under the id; an id the cache lacks offline is one error line, not a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.server_process import ROOT
from tests.integration.hf_cache import COMMIT, REPO_ID, hf_cache


def _bench(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"),
                        "HF_HOME": str(tmp_path / "home")}
    args = ["bench", "--in-process", "--threads", "1", "--concurrency", "1", "--requests", "2", "--warmup", "0",
            "--prompt-len", "8", "--gen-length", "8", "--steps", "8", "--block-length", "8", "--quiet", *argv]
    return subprocess.run([sys.executable, "-m", "celeris.server.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_bench_in_process_takes_a_hub_id_offline(tmp_path):
    hf_cache(tmp_path / "hub")
    report = tmp_path / "bench.json"
    out = _bench(tmp_path, "--model", REPO_ID, "--revision", COMMIT, "--report", str(report))
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(report.read_text())
    assert r["conditions"]["model"] == REPO_ID and r["results"]["ok"] == 2


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_bench_in_process_missing_hub_id_is_one_line(tmp_path):
    (tmp_path / "hub").mkdir()
    out = _bench(tmp_path, "--model", "celeris-org/not-cached")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("celeris bench: error: celeris-org/not-cached") and "HF_HUB_OFFLINE=1" in line
