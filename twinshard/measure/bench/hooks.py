"""Hook overhead: the CPU time each implementation spends per parameter group and step.

``run_hooks`` runs the implementations side by side under PyTorch's fake process group, then
each once more under ``cProfile``; ``breakdown`` sorts a profile's time into ``CATEGORIES`` by
the file each function lives in (``category``: the first fragment that matches wins, so the
narrower paths come first), and ``overhead_table`` and ``profile_tables`` write what is read.
``add_ratio_by_repetition`` pairs the k-th repetition of each implementation with torch's,
since those ran back to back.

The setting, the formula and how to read the tables: docs/benchmarks.md, "Hook overhead".
"""

from __future__ import annotations

import os
import pstats
import statistics
import tempfile
from dataclasses import replace

from twinshard.commandline.report_files import publish
from twinshard.measure.units import markdown_table, ratio

from .compare import side_by_side
from .report import meta
from .runner import run

# where a function lives (a fragment of its file path) -> the category it counts in
CATEGORIES = [
    ("/reference/", "twinshard.reference"),
    ("/optimized/", "twinshard.optimized"),
    ("twinshard/api/", "twinshard.api"),
    ("torch/distributed/fsdp/", "torch fsdp"),
    ("torch/distributed/tensor/", "DTensor"),
    ("torch/distributed/", "torch.distributed (c10d Python)"),
    ("torch/nn/modules/module.py", "nn.Module call and hooks"),
    ("torch/autograd/", "autograd Python"),
    ("torch/utils/hooks.py", "autograd Python"),
    ("torch/_ops.py", "dispatcher Python"),
    ("torch/utils/_pytree.py", "pytree"),
    ("torch/optim/", "optimizer"),
    ("twinshard/models.py", "model"),
    ("torch/nn/", "model"),
    ("torch/", "other torch Python"),
]


def category(filename: str, funcname: str) -> str:
    if filename == "~":  # a builtin: torch's C++ ops show up as methods of torch._C objects
        return "C++ ops and builtins"
    for fragment, name in CATEGORIES:
        if fragment in filename:
            return name
    return "other Python"


def breakdown(path: str, per: float) -> tuple[dict, list]:
    """(microseconds by category, the 12 costliest functions) from a cProfile file, each
    divided by ``per`` (steps x groups)."""
    stats = pstats.Stats(path).stats
    cats: dict[str, float] = {}
    rows = []
    for (filename, line, func), (_, calls, tottime, _cumtime, _) in stats.items():
        cat = category(filename, func)
        cats[cat] = cats.get(cat, 0.0) + tottime * 1e6 / per
        short = filename.split("site-packages/")[-1].split("/work/main/")[-1]
        rows.append((tottime * 1e6 / per, calls / per, f"{short}:{line}({func})", cat))
    rows.sort(reverse=True)
    return dict(sorted(cats.items(), key=lambda kv: -kv[1])), rows[:12]


def run_hooks(args, base, impls: list[str]) -> int:
    """``twinshard bench hooks``: ``impls`` on ``base`` (``compare.job_of``), then profiled."""
    base = replace(base, memory=False, profile=None)
    groups = base.llama().n_layers + 1
    result = side_by_side(base, impls, args.repeat, not args.no_progress)
    summary = result["summary"]
    floor = summary.get("plain", {}).get("cpu_s", 0.0)
    phase_floor = summary.get("plain", {}).get("phases_cpu_s") or [0.0] * 3
    for row in summary.values():
        row["overhead_per_group_s"] = (row["cpu_s"] - floor) / groups
        row["phase_overhead_per_group_s"] = [
            (a - b) / groups for a, b in zip(row["phases_cpu_s"], phase_floor)
        ]
    add_ratio_by_repetition(summary, result["runs"])
    profile_dir = args.profile or tempfile.mkdtemp(prefix="twinshard-hooks-")
    profiles = {}
    for impl in impls:
        run(replace(base, impl=impl, profile=profile_dir))
        cats, top = breakdown(os.path.join(profile_dir, f"{impl}.prof"), base.steps * groups)
        profiles[impl] = {"categories": cats, "top": top}
    text = overhead_table(summary, base, groups) + "\n\n" + profile_tables(profiles)
    payload = {"meta": meta(base.as_dict()), **result, "profiles": profiles}
    publish(text, args.markdown, args.json, payload)
    return 0


def add_ratio_by_repetition(summary: dict, runs: dict) -> None:
    """Each implementation's overhead over torch's, repetition by repetition: the k-th runs of
    plain, the implementation and torch ran one after the other, so each ratio compares
    processes that saw the machine in the same state. Their range shows how far the figure
    moves from one repetition to the next."""
    if "plain" not in runs or "torch" not in runs:
        return
    floor = [statistics.median(r["cpu_s"]) for r in runs["plain"]]

    def overheads(reps: list) -> list:  # per repetition: median CPU time over plain's
        return [statistics.median(r["cpu_s"]) - f for r, f in zip(reps, floor)]

    torch_over = overheads(runs["torch"])
    for name, reps in runs.items():
        if name not in ("plain", "torch"):
            ratios = [a / b for a, b in zip(overheads(reps), torch_over) if b > 0]
            summary[name]["vs_torch_by_repetition"] = ratios


def overhead_table(summary: dict, base, groups: int) -> str:
    torch_row = summary.get("torch")
    head = ["impl", "CPU ms/step", "wall ms/step", "overhead us/group", "vs torch"]
    head += ["vs torch, by repetition", "forward", "backward", "optimizer"]
    rows = []
    for name, r in summary.items():
        per = r["overhead_per_group_s"]
        compared = torch_row and name != "plain" and torch_row["overhead_per_group_s"] > 0
        reps = r.get("vs_torch_by_repetition")
        rows.append(
            [name, f"{r['cpu_s'] * 1e3:.2f}", f"{r['step_s'] * 1e3:.2f}", f"{per * 1e6:.0f}"]
            + [ratio(per / torch_row["overhead_per_group_s"] if compared else None)]
            + [f"{min(reps):.2f}-{max(reps):.2f}x" if reps else "-"]
            + [f"{x * 1e6:.0f}" for x in r["phase_overhead_per_group_s"]]
        )
    title = (
        f"{base.backend} world {base.world}, {groups - 1} blocks + root = {groups} groups, "
        f"dim {base.llama().dim}, {base.per_rank} x {base.seq} tokens; SGD {_optimizer(base)}; "
        "CPU time per step; overhead "
        "per group = (CPU time - plain's) / groups, in total and by phase (us)"
    )
    return title + "\n\n" + markdown_table(head, rows)


def _optimizer(config) -> str:
    foreach = config.device != "cpu" if config.foreach is None else config.foreach
    how = "foreach (multi-tensor operations)" if foreach else "a loop over the parameters"
    return how if config.foreach is not None else f"as torch chooses: {how}"


def profile_tables(profiles: dict) -> str:
    names = list(profiles)
    cats = sorted(
        {c for p in profiles.values() for c in p["categories"]},
        key=lambda c: -max(p["categories"].get(c, 0.0) for p in profiles.values()),
    )
    rows = [[c] + [f"{profiles[n]['categories'].get(c, 0.0):.1f}" for n in names] for c in cats]
    rows.append(
        ["total (profiled)"] + [f"{sum(profiles[n]['categories'].values()):.1f}" for n in names]
    )
    lines = ["cProfile, microseconds per group and step (self time, by where the code lives)", ""]
    lines.append(markdown_table(["where", *names], rows))
    for n in names:
        lines += ["", f"{n}: the costliest functions (us and calls per group and step)", ""]
        top = [[f"{us:.1f}", f"{calls:.1f}", f"`{fn}`"] for us, calls, fn, _ in profiles[n]["top"]]
        lines.append(markdown_table(["us", "calls", "function"], top))
    return "\n".join(lines)
