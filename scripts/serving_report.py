"""Medians, target ratios and the printed table of scripts/bench_serving.py."""

from __future__ import annotations

from typing import Any, Optional

COLUMNS = [  # (header, key, format) of a table row
    ("tok/s", "tokens_per_s", "{:9.1f}"), ("x eng", "x_engine", "{:6.2f}"), ("x sch", "x_scheduler", "{:6.2f}"),
    ("fw/st", "forwards_per_step", "{:5.2f}"), ("first50", "first_p50_ms", "{:8.1f}"),
    ("lat50", "latency_p50_ms", "{:8.1f}"), ("lat95", "latency_p95_ms", "{:8.1f}"),
    ("msg/req", "messages_per_request", "{:8.1f}"), ("kB/req", "kib_per_request", "{:8.1f}"),
    ("steps/s", "steps_per_s", "{:8.1f}"), ("fwd ms", "forward_ms", "{:7.2f}"), ("cpu ms", "cpu_ms", "{:7.2f}"),
    ("loop ms", "loop_cpu_ms", "{:7.2f}"), ("out ms", "outside_ms", "{:7.2f}"), ("cli ms", "client_cpu_ms", "{:7.2f}"),
]


def median_by(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The whole run whose `key` is the median (its figures stay consistent with each other)."""
    return sorted(runs, key=lambda r: r[key])[len(runs) // 2]


def _nearest(values: list[int], want: int) -> Optional[int]:
    return min(values, key=lambda v: (abs(v - want), -v)) if values else None


def targets(report: dict[str, Any]) -> dict[str, Any]:
    """The issue's ratios from this run. Where the run lacks the target's shape (--quick) the
    nearest cells stand in, and `shape` says which; `met` is None when a figure is missing."""
    cells = report["cells"]
    out: dict[str, Any] = {}
    concs = sorted({c["concurrency"] for c in cells.values()})
    gens = sorted({c["gen_length"] for c in cells.values()})
    conc = _nearest(concs, 16)
    stream = "delta" if "delta" in report["conditions"]["modes"] else "full"
    for gen in gens:  # the base: the in-process scheduler on the same load (the engine's waves: reference)
        c = cells.get(f"{gen}/{conc}")
        for base in ("scheduler", "engine"):
            ratio = None
            if c and stream in c["modes"] and base in c["modes"]:
                ratio = c["modes"][stream]["tokens_per_s"] / c["modes"][base]["tokens_per_s"]
            out[f"a_grpc_over_{base}_gen{gen}"] = {
                "shape": f"{stream} stream, concurrency {conc}, gen {gen}", "ratio": ratio, "goal": ">= 0.9",
                "met": None if ratio is None or stream != "delta" else ratio >= 0.9}
    sim = report.get("simulation")
    out["b_sim_server_over_runner"] = {
        "shape": f"{sim['step_ms']:g} ms step, batch {sim['batch']}, gen {sim['gen_length']}, {sim['mode']} stream"
        if sim else "no simulation", "ratio": sim["ratio"] if sim else None, "goal": ">= 0.95",
        "met": None if not sim or sim["mode"] != "delta" else sim["ratio"] >= 0.95}
    gen = _nearest(gens, 256)
    c = cells.get(f"{gen}/{conc}") or {"modes": {}}
    both = "delta" in c["modes"] and "full" in c["modes"]
    ratio = c["modes"]["delta"]["bytes_per_request"] / c["modes"]["full"]["bytes_per_request"] if both else None
    out["c_delta_over_full_bytes"] = {"shape": f"concurrency {conc}, gen {gen}", "ratio": ratio, "goal": "<= 0.10",
                                      "met": None if ratio is None else ratio <= 0.10}
    return out


def _fmt(fmt: str, value: Any) -> str:
    width = len(fmt.format(0.0))
    return "-".rjust(width) if value is None else fmt.format(value)


def _row(conc: int, mode: str, r: dict[str, Any], engine_tps: float, scheduler_tps: Optional[float]) -> str:
    r = dict(r, x_engine=r["tokens_per_s"] / engine_tps if engine_tps else None,
             x_scheduler=r["tokens_per_s"] / scheduler_tps if scheduler_tps else None,
             kib_per_request=r["bytes_per_request"] / 1024 if "bytes_per_request" in r else None)
    return f"{conc:5d} {mode:12}" + " ".join(_fmt(f, r.get(k)) for _, k, f in COLUMNS)


def format_report(report: dict[str, Any]) -> str:
    c = report["conditions"]
    head = f"{'conc':>5} {'mode':12}" + " ".join(h.rjust(len(f.format(0.0))) for h, _, f in COLUMNS)
    lines = [f"\nceleris serving benchmark: {c['model']} ({c['dtype']}, {c['device']}), {c['threads']} torch threads, "
             f"{c['cpus_available']} CPUs available of {c['cpu_count']}, {c['machine']}, commit {c['commit']}, "
             f"median of {c['repeats']}",
             f"decoder: {c['decoder']}; server: `celeris serve` process; clients: {c['clients']}",
             "engine: LLM.generate in waves; scheduler: the in-process Scheduler, closed-loop clients, no transport; "
             "fw/st = forwards per step",
             "per server step: fwd = forward wall time (engine rows: the engine's whole step); cpu = server process "
             "CPU; loop = event-loop thread CPU; out = cpu - fwd (one core); cli = client process CPU"]
    for gen in sorted({x["gen_length"] for x in report["cells"].values()}):
        group = [x for x in report["cells"].values() if x["gen_length"] == gen]
        g = group[0]
        lines += [f"\ngen_length {gen} (steps {g['steps']}, block {g['block_length']})", head]
        for x in sorted(group, key=lambda x: x["concurrency"]):
            engine_tps = x["modes"]["engine"]["tokens_per_s"]
            scheduler_tps = x["modes"].get("scheduler", {}).get("tokens_per_s")
            lines += [_row(x["concurrency"], m, r, engine_tps, scheduler_tps) for m, r in x["modes"].items()]
            failed = sum(r.get("failed", 0) for r in x["modes"].values())
            if failed:
                lines.append(f"      {failed} failed requests: "
                             f"{'; '.join(e for r in x['modes'].values() for e in r.get('errors', []))}")
    sim = report.get("simulation")
    if sim:
        s = sim["server"]
        lines += [f"\nsimulated GPU step {sim['step_ms']:g} ms, {sim['batch']} concurrent {sim['mode']} streams, "
                  f"gen {sim['gen_length']}: runner alone {sim['runner_steps_per_s']:.2f} steps/s, "
                  f"server {s['steps_per_s']:.2f} steps/s = {sim['ratio']:.3f}x; per step fwd {s['forward_ms']:.2f} ms, "
                  f"server cpu {s['cpu_ms']:.2f} ms (event loop {s['loop_cpu_ms']:.2f} ms)"]
    lines.append("\ntargets:")
    for name, t in report["targets"].items():
        ratio = "-" if t["ratio"] is None else f"{t['ratio']:.3f}"
        met = {None: "n/a (needs delta streaming / the full configuration)", True: "met", False: "NOT met"}[t["met"]]
        lines.append(f"  {name:31} {ratio:>7}  goal {t['goal']:8} [{t['shape']}]  {met}")
    return "\n".join(lines)
