"""scripts/schema_coverage.py over a folder laid out as JSONSchemaBench's data/<subset>/*.json,
with schemas written for this test (the benchmark's own cannot ship): per-subset accepted % beside
llguidance's, refusals counted by reason, and a generated sample validated through both doors at
fewer steps than tokens (each slot chains several positions a step)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"

SCHEMAS = {
    "alpha": {
        "a.json": {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
                   "required": ["n"]},
        "b.json": {"$ref": "#/$defs/x", "$defs": {"x": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}},
        "c.json": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},  # llguidance refuses `not`
    },
    "beta": {
        "d.json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                   "additionalProperties": False},
        "e.json": {"type": "string", "enum": ["red", "green"]},
    },
}


def _lay_out(root: Path) -> None:
    for subset, files in SCHEMAS.items():
        (root / subset).mkdir(parents=True)
        for name, schema in files.items():
            (root / subset / name).write_text(json.dumps(schema))
    (root / "beta" / "broken.json").write_text("{not json")  # unreadable files are skipped


def _main(args: list[str]) -> None:
    sys.path.insert(0, str(SCRIPTS))
    try:
        import schema_coverage
        schema_coverage.main(args)
    finally:
        sys.path.remove(str(SCRIPTS))


@pytest.mark.parametrize("door", ["engine", pytest.param("http", marks=pytest.mark.slow)])
def test_coverage_and_a_validated_sample(tmp_path, capsys, door):
    pytest.importorskip("jsonschema")
    if door == "http":
        pytest.importorskip("openai")
    _lay_out(tmp_path)
    _main([str(tmp_path), "--max-tokens", "64", "--generate", "4", "--seeds", "2", "--gen-length", "64",
           "--steps", "16", "--door", door])
    out = capsys.readouterr().out
    assert re.search(r"^alpha\s+3\s+66\.7\s+66\.7 ", out, re.M), out  # llguidance 2 of 3, Celeris the same 2
    assert re.search(r"^beta\s+2\s+100\.0\s+100\.0 ", out, re.M), out
    assert re.search(r"^ALL\s+5 ", out, re.M), out
    assert "1  llguidance: Unimplemented keys" in out.split("refusals (first reason):")[1], out  # `not`
    assert f"generated 8 (4 schemas x 2 seeds, gen_length 64, steps 16, door {door})" in out, out
    assert "valid 8/8 (100.0%), ran out of max_tokens 0" in out, out
    if door == "http":  # progress carries the running validity
        assert "8/8 answered, 8 valid" in out, out


def test_multiple_of_is_checked_in_exact_decimals():
    """4.6 is a multiple of 0.01 (JSON Schema: the division's result is an integer); jsonschema's
    float division says 459.99999999999994. The exact check agrees with it everywhere else."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        from schema_coverage import validates
    finally:
        sys.path.remove(str(SCRIPTS))
    cents = {"type": "object", "properties": {"p": {"type": "number", "multipleOf": 0.01}}}
    assert validates(cents, '{"p": 4.6}') is None
    assert validates(cents, '{"p": 4.6}', exact=False) is not None  # jsonschema's float artefact
    for bad in ('{"p": 4.605}', '{"p": 1e400}', '{"p": 0.001}'):
        assert validates(cents, bad) is not None, bad
    for good in ('{"p": 0}', '{"p": -12.34}', '{"p": 7}', '{"p": 1.5e3}'):
        assert validates(cents, good) is None and validates(cents, good, exact=False) is None, good
    assert validates({"type": "integer", "multipleOf": 3}, "10") is not None
    assert validates({"type": "integer", "multipleOf": 3}, "12") is None
