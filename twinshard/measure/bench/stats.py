"""From raw runs to the numbers a reader compares: medians, spread, ratios, overlap.

``summarize`` pools the step times of one implementation's repetitions into its figures
(``quantiles`` of single steps, repetition medians, tokens per second, CPU time, the probe's
memory and the part of it FSDP adds on top of the persistent state, ``TRACKED``); ``add_ratios``
and ``add_overlap`` then add what needs
every implementation's summary (the ratios to DDP and to torch) or the instant network's run
(``overlap_efficiency``). Nothing here runs or prints anything.

What each figure means and the overlap formula: docs/benchmarks.md, "What one run measures"
and "Overlap efficiency".
"""

from __future__ import annotations

import statistics

TRACKED = ("unsharded", "grad", "comm", "sharded_grad")  # what FSDP adds to shards and state


def quantiles(values: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile)."""
    values = sorted(values)
    if len(values) == 1:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[1], q[2]


def overlap_efficiency(
    compute: float, comm: float, measured: float, first: float, last: float
) -> float | None:
    """docs/benchmarks.md, "Overlap efficiency"; None when there is too little to overlap to
    measure it: less than 5% of the serial time (then noise in the step times would decide the
    figure)."""
    serial = compute + comm
    ideal = max(compute, comm) + first + last
    if serial - ideal < 0.05 * serial:
        return None
    return (serial - measured) / (serial - ideal)


def summarize(runs: list[dict], tokens_per_step: int) -> dict:
    """One configuration's repetitions -> its figures."""
    wall = [s for r in runs for s in r["wall_s"]]
    cpu = [s for r in runs for s in r["cpu_s"]]
    q1, med, q3 = quantiles(wall)
    reps = [statistics.median(r["wall_s"]) for r in runs]
    phases = [p for r in runs for p in r.get("phases_cpu_s", [])]  # forward, backward, optimizer
    out = {
        "step_s": med,
        "step_q1_s": q1,
        "step_q3_s": q3,
        "rep_min_s": min(reps),
        "rep_max_s": max(reps),
        "cpu_s": statistics.median(cpu),
        "phases_cpu_s": [statistics.median(p[k] for p in phases) for k in range(3)]
        if phases
        else None,
        "tokens_per_s": tokens_per_step / med,
        "steps": len(wall),
        "loss": runs[-1]["loss"],
        "params": runs[-1]["params"],
        "rss_growth": statistics.median(r["rss_growth"] for r in runs),
    }
    last = runs[-1]
    if "memory" in last:
        out["memory"] = last["memory"]
        out["memory_total"] = last["memory_total"]
        out["tracked"] = sum(last["memory"].get(c, 0) for c in TRACKED)
        out["heap_peak"] = statistics.median(r["heap_peak"] for r in runs)
        out["collectives"] = last["collectives"]
    if "accelerator_peak" in last:
        out["accelerator_peak"] = statistics.median(r["accelerator_peak"] for r in runs)
    comm = [c for r in runs for c in r.get("comm", [])]
    if comm:
        for key in ("comm_s", "first_all_gather_s", "last_reduce_scatter_s"):
            out[key] = statistics.median(c[key] for c in comm)
    return out


def add_ratios(summary: dict) -> None:
    """Step time and memory as ratios to DDP and to torch's fully_shard, where they ran."""
    for base in ("ddp", "torch"):
        if base not in summary:
            continue
        for row in summary.values():
            row[f"step_vs_{base}"] = row["step_s"] / summary[base]["step_s"]
            a, b = row.get("memory_total"), summary[base].get("memory_total")
            if a and b:
                row[f"memory_vs_{base}"] = a / b


def add_overlap(summary: dict, instant: dict) -> None:
    """Overlap efficiency of each implementation; ``instant`` holds the same runs on an
    instant network (their compute)."""
    for name, row in summary.items():
        if name not in instant or "comm_s" not in row:
            continue
        row["compute_s"] = instant[name]["step_s"]
        row["overlap_efficiency"] = overlap_efficiency(
            row["compute_s"],
            row["comm_s"],
            row["step_s"],
            row["first_all_gather_s"],
            row["last_reduce_scatter_s"],
        )
