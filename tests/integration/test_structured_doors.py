"""scripts/bench_structured.py's validity sweep through its doors: a real server on free ports,
gRPC through the Python client and HTTP through the official `openai` SDK, on celeris-tiny with
one seed and a few schemas and regexes/choices; every output parses and validates."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from celeris.engine.llm import LLM

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import bench_structured
        yield bench_structured
    finally:
        sys.path.remove(str(SCRIPTS))


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_grpc_and_http_doors_give_valid_outputs(bench):
    jobs = [("json_schema", bench.SCHEMAS[8], 0), ("json_schema", bench.SCHEMAS[16], 0),
            ("regex", bench.REGEXES[2][1], 0), ("choice", bench.REGEXES[8][1], 0)]
    loaded: list[LLM] = []

    def load() -> LLM:
        loaded.append(LLM.load())
        return loaded[-1]
    seen = []
    for door, outcomes, _ in bench.through_doors(load, ["grpc", "http"], jobs):
        seen.append(door)
        ok_s, n_s, ok_r, n_r, bad = bench.tally(jobs, outcomes)
        assert (ok_s, n_s, ok_r, n_r, bad) == (2, 2, 2, 2, []), (door, bad)
    assert seen == ["grpc", "http"]
    assert len(loaded) == 1 and loaded[0].loop.idle  # one server for both doors, left with nothing running


def test_a_refused_request_counts_as_invalid_with_its_error(bench):
    jobs = [("regex", "a+", 0), ("choice", ["yes", "no"], 0)]  # an unbounded regex is refused
    for door, outcomes, _ in bench.through_doors(LLM.load, ["grpc", "http"], jobs):
        ok_s, n_s, ok_r, n_r, bad = bench.tally(jobs, outcomes)
        assert (ok_s, n_s, ok_r, n_r) == (0, 0, 1, 2), door
        assert len(bad) == 1 and "unbounded" in bad[0], (door, bad)
