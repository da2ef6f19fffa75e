"""How cost grows: one command sweeps model size, number of groups and world size.

``POINTS`` holds the values of each swept quantity around its ``BASES`` point (``--points
quick``: a smaller set around a 2-rank point, for a check), ``point`` makes the job for one of them, ``run_sweep`` runs and
records them all and ``plot_axis`` draws one quantity's plot; ``replot`` draws a recorded
sweep again.

What is swept and what the plots show: docs/benchmarks.md, "How cost grows".
"""

from __future__ import annotations

import json
import os

from twinshard.commandline.report_files import write_json
from twinshard.measure import grid
from twinshard.measure.job import Job
from twinshard.measure.units import MiB, figure, ms

from .compare import add_memory_model, side_by_side
from .report import meta

# the point every other quantity is held at while one is swept
BASES = {"full": dict(dim=64, n_layers=4, world=8), "quick": dict(dim=32, n_layers=2, world=2)}
AXES = {"model size": "dim", "groups": "n_layers", "world size": "world"}  # what each sets
POINTS = {
    "full": {"model size": [64, 128, 256], "groups": [2, 8, 32], "world size": [2, 8, 64]},
    "quick": {"model size": [32, 64], "groups": [1, 2], "world size": [2, 4]},
}
FILES = {axis: f"sweep-{axis.replace(' ', '-')}.png" for axis in POINTS["full"]}


def point(base: Job, axis: str, value: int, points: str = "full") -> Job:
    """``base`` at ``BASES[points]`` with ``axis`` set to ``value`` (model size is the width,
    with a head per 32 of it)."""
    chosen = {**BASES[points], AXES[axis]: value}
    heads = max(2, chosen["dim"] // 32)
    return grid.at(base, {**chosen, "n_heads": heads, "n_kv_heads": heads})


def replot(args) -> int:
    """``--from-json``: plot a recorded sweep again, with the memory prediction recorded."""
    with open(args.from_json) as f:
        recorded = json.load(f)
    base = Job(**recorded["meta"]["config"])
    for axis in FILES:
        impls = list(recorded[axis][0]["summary"])
        plot_axis(axis, recorded[axis], impls, os.path.join(args.out, FILES[axis]), base)
    write_json(os.path.join(args.out, "sweep.json"), recorded)
    return 0


def run_sweep(args, base: Job, impls: list[str]) -> int:
    """``impls`` at every point around ``base`` (``compare.job_of``: simnet, tiny, world 8)."""
    name = args.points or "full"
    results: dict = {}
    for axis, values in POINTS[name].items():
        results[axis] = []
        for value in values:
            config = point(base, axis, value, name)
            out = side_by_side(config, impls, args.repeat, not args.no_progress, overlap=False)
            summary = out["summary"]
            groups = config.llama().n_layers + 1
            floor = summary.get("plain", {}).get("cpu_s", 0.0)
            for row in summary.values():
                row["overhead_per_group_s"] = (row["cpu_s"] - floor) / groups
            results[axis].append({"value": value, "config": config.as_dict(), "summary": summary})
            print(f"{axis} = {value}: " + _line(summary), flush=True)
    if base.memory:  # every point's prediction, recorded in one process
        points = [(r["summary"], Job(**r["config"])) for rows in results.values() for r in rows]
        add_memory_model(points)
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "sweep.json"), {"meta": meta(base.as_dict()), **results})
    for axis, rows in results.items():
        plot_axis(axis, rows, impls, os.path.join(args.out, FILES[axis]), base)
    return 0


def _line(summary: dict) -> str:
    return ", ".join(
        f"{n} {ms(r['step_s'])} ms / {r.get('memory_total', 0) / MiB:.2f} MB"
        for n, r in summary.items()
    )


def plot_axis(axis: str, rows: list, impls: list, path: str, base: Job) -> None:
    """Step time, overhead per group and peak memory against ``axis``, one line per impl."""
    xs = [r["value"] for r in rows]
    panels = [
        ("step time (ms)", lambda s: s["step_s"] * 1e3),
        ("overhead per group (us CPU)", lambda s: s["overhead_per_group_s"] * 1e6),
        ("peak FSDP memory (MB)", lambda s: s.get("memory_total", 0) / MiB),
    ]
    with figure(path, 100, 1, 3, figsize=(10, 3)) as (fig, axes):
        for ax, (title, value) in zip(axes, panels):
            for impl in impls:
                ys = [value(r["summary"][impl]) for r in rows if impl in r["summary"]]
                ax.plot(xs[: len(ys)], ys, marker="o", label=impl)
                if title.startswith("peak") and impl != "plain":
                    model = [r["summary"][impl].get("model_total", 0) / MiB for r in rows]
                    ax.plot(xs, model, linestyle=":", color=ax.lines[-1].get_color())
            ax.set_xscale("log", base=2)
            ax.set_xlabel(axis + (" (width)" if axis == "model size" else ""))
            ax.set_title(title, fontsize=9)
        axes[0].legend(fontsize=7)
        link = f", link {base.link}" if base.backend == "simnet" else ""
        fig.suptitle(f"{base.backend}{link}; dotted: memory prediction", fontsize=8)
