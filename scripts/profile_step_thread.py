"""Where the server's step thread spends its time under streaming load: the model's forward's
share of the step worker's busy time, sampled with py-spy (in the dev extra: `pip install -e '.[dev]'`).
Stopped early (Ctrl-C, SIGTERM, SIGHUP) it stops its server and client processes before it exits.

    python scripts/profile_step_thread.py                          # celeris-tiny-block, 16 delta streams, 15 s
    python scripts/profile_step_thread.py --model celeris-tiny --kv-cache dual --seconds 20

`celeris serve` runs in its own process and the clients in another (bench_serving's), 16
concurrent every-step delta streams of gen_length 256, steps 256, block 32, threshold 0.9,
re-sent as they end. py-spy samples the server by wall time (`--idle`: waiting threads too). A
sample is the step thread's when its stack holds `StepWorker.work`; idle when that thread waits
for work (its `_kick`); the rest is the thread's busy time: a sample with a frame of the
model's forward on its stack (engine/models/transformer.py, moe.py, gemma.py, attention.py, cache.py) is
forward; else one with a frame of the runner around it (the runners, sampler, sampling batch,
graphs) is runner; else the rest (the step loop, sequences, events, the hand-off). A wait for the
GIL counts where the thread waits: inside the forward (a torch op returning) as forward.
Prints the split and the share of the forward (issue #28's target: >= 60%).
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark import TEXT_PROMPTS  # noqa: E402
from serving_process import ClientProcess, ServeProcess  # noqa: E402

FORWARD = ("engine/models/transformer.py", "engine/models/moe.py", "engine/families/revise/model.py", "engine/models/attention.py", "engine/models/cache.py")
RUNNER = ("engine/families/canvas/runner.py", "engine/families/block/runner.py", "engine/families/revise/runner.py", "engine/sampling/select.py",
          "engine/sampling/batch.py", "engine/families/selection.py", "engine/loop/runner_api.py", "engine/models/graphs.py")


def classify(frames: list[str]) -> str | None:
    """'idle', 'forward', 'runner', 'other' for a sample of the step thread; None for other threads."""
    name = lambda f: f.split(" (")[0].rsplit(".", 1)[-1]  # noqa: E731  "StepWorker.work (path:line)" -> "work"
    at = next((i for i, f in enumerate(frames) if name(f) == "work" and "step_worker.py" in f), None)
    if at is None:
        return None
    below = frames[at + 1:]
    if not below or name(below[0]) == "wait" and "threading.py" in below[0]:
        return "idle"
    if any(any(p in f for p in FORWARD) for f in below):
        return "forward"
    if any(any(p in f for p in RUNNER) for f in below):
        return "runner"
    return "other"


def split(raw: str) -> collections.Counter:
    """Samples per class from py-spy's raw (collapsed) output: `frame;frame;... count`, root first."""
    counts: collections.Counter = collections.Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        kind = classify(stack.split(";"))
        if kind is not None:
            counts[kind] += int(n)
    return counts


def load(args: argparse.Namespace, server: ServeProcess, client: ClientProcess, stop: threading.Event) -> None:
    spec = {"gen_length": args.gen_length, "steps": args.gen_length, "block_length": 32, "threshold": 0.9, "seed": 0}
    while not stop.is_set():
        reqs = [dict(spec, prompt=p) for p in (TEXT_PROMPTS * 8)[:2 * args.concurrency]]
        client.run({"target": server.target, "concurrency": args.concurrency, "mode": "delta", "requests": reqs})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="celeris-tiny-block")
    ap.add_argument("--kv-cache", default="none", choices=("none", "prefix", "dual"))
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if shutil.which("py-spy") is None:
        print("py-spy is not installed: pip install py-spy (it is in the dev extra)", file=sys.stderr)
        return 2
    stop_on_signals()
    with tempfile.TemporaryDirectory(prefix="profile-step-") as tmp, ClientProcess() as client, \
            ServeProcess(None, args.threads, args.concurrency, args.kv_cache, Path(tmp) / "server.log",
                         max_gen_length=args.gen_length, extra=("--model", args.model)) as server:
        stop = threading.Event()
        driver = threading.Thread(target=load, args=(args, server, client, stop), daemon=True)
        driver.start()
        out = Path(tmp) / "profile.txt"
        print(f"sampling the server (pid {server.proc.pid}) for {args.seconds:g} s under "
              f"{args.concurrency} delta streams of {args.model}...", flush=True)
        subprocess.run(["py-spy", "record", "--pid", str(server.proc.pid), "--duration", str(int(args.seconds)),
                        "--rate", "250", "--format", "raw", "--idle", "--output", str(out)],
                       check=True, capture_output=True)
        stop.set()
        driver.join()
        counts = split(out.read_text())
    busy = counts["forward"] + counts["runner"] + counts["other"]
    report = {"model": args.model, "kv_cache": args.kv_cache, "concurrency": args.concurrency,
              "gen_length": args.gen_length, "threads": args.threads, "samples": dict(counts),
              "forward_share_of_busy": counts["forward"] / busy if busy else None}
    print(f"step thread samples: {dict(counts)}")
    if busy:
        print("of its busy time: " + ", ".join(f"{k} {100 * counts[k] / busy:.1f}%" for k in ("forward", "runner", "other")))
        print(f"forward share {100 * report['forward_share_of_busy']:.1f}% (goal >= 60%)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def stop_on_signals() -> None:
    """SIGTERM and SIGHUP end this process with SystemExit, as Ctrl-C does with KeyboardInterrupt,
    so the `with` blocks stop the server and the client; by default they end it at once and leave
    `celeris serve` running with nobody to stop it."""
    def leave(signum: int, frame) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, leave)


if __name__ == "__main__":
    raise SystemExit(main())
