"""scripts/fp8_quality.py's smoke mode (tiny shapes, CPU, the fp8 reference path) writes the report
the device run writes: conditions, and per model the logit and greedy-decode agreement figures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"


def test_smoke_report_has_every_model_and_figure(tmp_path):
    sys.path.insert(0, str(SCRIPTS))
    try:
        import fp8_quality
        out = tmp_path / "fp8.json"
        assert fp8_quality.main(["--smoke", "--json", str(out)]) == 0
    finally:
        sys.path.remove(str(SCRIPTS))
    report = json.loads(out.read_text())
    assert report["conditions"]["fp8_path"].startswith("reference") and report["speed"] == []
    rows = {r["model"]: r for r in report["rows"]}
    assert set(rows) == {"dense-tiny", "moe-tiny", "diffusion-gemma-tiny"}
    for name in ("dense-tiny", "moe-tiny"):
        fig = rows[name]["logits"]["fp8 vs bf16"]
        assert 0.9 < fig["cosine_mean"] <= 1 and 0 <= fig["top1_agreement"] <= 1
        assert 0 <= rows[name]["greedy_decode"]["fp8 vs bf16"]["token_agreement"] <= 1
    assert any(k.startswith("fp8 vs") for k in rows["diffusion-gemma-tiny"]["logits"])
