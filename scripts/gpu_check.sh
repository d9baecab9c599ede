#!/usr/bin/env bash
# Issue 28's device check in one command, within 13.5 minutes of GPU time (the phase timeouts'
# sum): tests/gpu, then scripts/bench_gpu.py, then DiffusionGemma's (scripts/bench_gemma.py, issue
# 46: the 26B-A4B shapes, random bf16 weights, peak memory per sequence and decode tok/s at batch 1
# and 8, 16 and 48 steps), then FP8's, each phase under its own timeout; leaves ONE results file,
# $OUT/gpu-check.json (or ./gpu-check.json), holding the tests' outcome and the benchmark reports.
# The served DiffusionGemma check (gRPC and HTTP on CUDA) is tests/gpu/test_revise_cuda.py, in phase 1.
#
#   bash scripts/gpu_check.sh [results-dir]
#   CELERIS_GPU_CHECK_PHASES=tests,bench bash scripts/gpu_check.sh   # some phases only
#
# The four phases' timeouts (13.5 min) pass one device command's 10-minute limit and, with the
# machine's start, a session's 15 minutes: run tests,bench in one call and gemma,fp8 in another
# (two results files, merged by hand), or the phases a session needs.
# Wheels the GPU machine lacks travel in .whl/ (see ../shared/GPU.md for the pip download line);
# they are installed into /tmp/site without the network. Rehearse on the CPU with
#   CELERIS_GPU_CHECK_SMOKE=1 bash scripts/gpu_check.sh /tmp/x
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-.}}"
mkdir -p "$OUT_DIR"
WORK="$(mktemp -d)"
# The checkout is not installed there: its installed names (celeris.engine, celeris.server,
# celeris.v1, celeris_client) are links to its folders, first on the path.
SHIM="$WORK/shim"
mkdir -p "$SHIM/celeris"
ln -s "$PWD/engine" "$SHIM/celeris/engine"
ln -s "$PWD/server" "$SHIM/celeris/server"
ln -s "$PWD/clients/celeris/v1" "$SHIM/celeris/v1"
ln -s "$PWD/clients" "$SHIM/celeris_client"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "wheel install failed" >&2
  export PYTHONPATH="$SHIM:/tmp/site:$PWD"
else
  export PYTHONPATH="$SHIM:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -c "import celeris.engine.llm, celeris.server.app, celeris.v1.generation_pb2, celeris_client" \
  || echo "the checkout's packages do not import" >&2
export PYTHONUNBUFFERED=1
START=$(date +%s)
SMOKE="${CELERIS_GPU_CHECK_SMOKE:-}"
PHASES=",${CELERIS_GPU_CHECK_PHASES:-tests,bench,gemma,fp8},"
want() { [[ "$PHASES" == *",$1,"* ]]; }

# phase NAME SECONDS CMD...: run CMD under its timeout if NAME is wanted; its output in
# $WORK/NAME.txt, its exit status in $WORK/NAME.rc (124: the timeout), its tail printed.
phase() {
  local name="$1" seconds="$2"
  shift 2
  want "$name" || return 0
  timeout "$seconds" "$@" >"$WORK/$name.txt" 2>&1
  echo $? >"$WORK/$name.rc"
  tail -5 "$WORK/$name.txt"
}

# Phase 1: tests/gpu (skipped without CUDA), 180 s.
TESTS=(tests/gpu)
[ -n "$SMOKE" ] && TESTS=(tests/gpu/test_graph_modes.py tests/gpu/test_revise_cuda.py)
phase tests 180 python3 -m pytest -q -p no:cacheprovider -o addopts="" --junitxml="$WORK/tests.xml" "${TESTS[@]}"

# Phase 2: the benchmark, 270 s (step rows stop starting after 160 s; the served phase follows).
BENCH_ARGS=(--json "$WORK/bench.json" --budget-s 160)
[ -n "$SMOKE" ] && BENCH_ARGS=(--smoke --json "$WORK/bench.json")
phase bench 270 python3 scripts/bench_gpu.py "${BENCH_ARGS[@]}"

# Phase 3: DiffusionGemma, 240 s (decode rows stop starting after 150 s).
GEMMA_ARGS=(--json "$WORK/gemma.json" --budget-s 150)
[ -n "$SMOKE" ] && GEMMA_ARGS=(--smoke --json "$WORK/gemma.json")
phase gemma 240 python3 scripts/bench_gemma.py "${GEMMA_ARGS[@]}"

# Phase 4: FP8 weights (issue 46), 120 s: fp8 vs bf16 step speed at batch 1 and 32 (LLaDA-8B shapes,
# random weights), then logit and greedy-token agreement on random tiny and mid shapes
# (scripts/fp8_quality.py).
FP8_ARGS=(--json "$WORK/fp8.json")
[ -n "$SMOKE" ] && FP8_ARGS=(--smoke --json "$WORK/fp8.json")
phase fp8 120 python3 scripts/fp8_quality.py "${FP8_ARGS[@]}"

# One results file.
python3 - "$WORK" "$OUT_DIR/gpu-check.json" "$START" "$PHASES" <<'PY'
import json, sys, time, xml.etree.ElementTree as ET
from pathlib import Path
work, out, start = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
def read(name, default=None):
    p = work / name
    return p.read_text() if p.exists() else default
tests = {"rc": int(read("tests.rc", "-1")), "tail": (read("tests.txt", "") or "").splitlines()[-40:], "cases": []}
if (work / "tests.xml").exists():
    for case in ET.parse(work / "tests.xml").iter("testcase"):
        status = "failed" if case.find("failure") is not None or case.find("error") is not None else (
            "skipped" if case.find("skipped") is not None else "passed")
        tests["cases"].append({"name": case.get("name"), "status": status, "seconds": float(case.get("time", 0))})
bench = json.loads(read("bench.json", "null") or "null")
report = {"tests": tests, "bench": bench, "bench_rc": int(read("bench.rc", "-1")),
          "bench_tail": (read("bench.txt", "") or "").splitlines()[-40:],
          "gemma": json.loads(read("gemma.json", "null") or "null"), "gemma_rc": int(read("gemma.rc", "-1")),
          "gemma_tail": (read("gemma.txt", "") or "").splitlines()[-20:], "wall_s": int(time.time()) - start,
          "phases": sys.argv[4].strip(",").split(",")}  # a phase not run reads rc -1
report.update(fp8=json.loads(read("fp8.json", "null") or "null"), fp8_rc=int(read("fp8.rc", "-1")),
              fp8_tail=(read("fp8.txt", "") or "").splitlines()[-20:])
out.write_text(json.dumps(report, indent=2) + "\n")
print(f"wrote {out}: tests rc {tests['rc']}, bench rc {report['bench_rc']}, gemma rc {report['gemma_rc']}, "
      f"{report['wall_s']} s")
PY
rm -rf "$WORK"
