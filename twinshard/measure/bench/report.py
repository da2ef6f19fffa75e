"""What a comparison prints and writes: the table, the memory table, JSON, the plot."""

from __future__ import annotations

import os
import platform
import sys
import time

import torch

from twinshard.measure.units import MiB, figure, markdown_table, ms, ratio


def _collectives(collectives: dict | None) -> list[str]:
    """Two cells: the count of each kind of collective ("AG 3 RS 2") and their MB per step."""
    if not collectives:
        return ["-", "-"]
    short = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "broadcast": "BC"}
    ops = " ".join(f"{short.get(op, op)} {v['count']}" for op, v in sorted(collectives.items()))
    return [ops, f"{sum(v['bytes'] for v in collectives.values()) / MiB:.1f}"]


def table(summary: dict) -> str:
    """Step time (median and quartiles), tokens/s, ratios, memory and collectives."""
    simnet = any("overlap_efficiency" in r or "comm_s" in r for r in summary.values())
    head = ["impl", "step ms (q1-q3)", "tokens/s", "vs DDP", "vs torch", "peak MB"]
    head += ["collectives/step", "MB/step"]
    if simnet:
        head += ["compute ms", "comm ms", "overlap"]
    rows = []
    for name, r in summary.items():
        peak = r.get("accelerator_peak", r.get("memory_total"))
        cells = [
            name,
            f"{ms(r['step_s'])} ({ms(r['step_q1_s'])}-{ms(r['step_q3_s'])})",
            f"{r['tokens_per_s']:.0f}",
            ratio(r.get("step_vs_ddp")),
            ratio(r.get("step_vs_torch")),
            f"{peak / MiB:.2f}" if peak is not None else "-",
            *_collectives(r.get("collectives")),
        ]
        if simnet:
            eff = r.get("overlap_efficiency")
            cells += [
                ms(r["compute_s"]) if "compute_s" in r else "-",
                ms(r["comm_s"]) if "comm_s" in r else "-",
                f"{eff:.2f}" if eff is not None else "-",
            ]
        rows.append(cells)
    return markdown_table(head, rows)


def memory_table(summary: dict) -> str:
    """Bytes at the peak by category, measured (probe) and predicted (``measure.memory``)."""
    head = ["impl", "sharded+optim MB", "unsharded MB", "grad MB", "sharded grad MB", "comm MB"]
    head += ["peak MB", "model MB", "model/measured", "heap MB", "RSS growth MB"]
    rows = []
    for name, r in summary.items():
        m = r.get("memory")
        if not m:
            continue
        model, total = r.get("model_total"), r["memory_total"]
        persistent = m["sharded"] + m["optimizer"] + m["params"]
        mb = [persistent, m["unsharded"], m["grad"], m["sharded_grad"], m["comm"], total]
        cells = [name, *(f"{b / MiB:.2f}" for b in mb)]
        cells += [f"{model / MiB:.2f}", f"{model / total:.3f}"] if model else ["-", "-"]
        cells += [f"{r['heap_peak'] / MiB:.1f}", f"{r['rss_growth'] / MiB:.1f}"]
        rows.append(cells)
    return markdown_table(head, rows)


def meta(config_dict: dict, argv: list[str] | None = None) -> dict:
    """Date, command, machine and load: what a reader needs to judge the numbers."""
    info = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(["twinshard", "bench", *_bench_args(argv)]),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu": _cpu_name(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "threads_per_rank": int(os.environ.get("TWINSHARD_THREADS", "1") or "0"),
        "config": config_dict,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _bench_args(argv: list[str] | None) -> list[str]:
    args = sys.argv[1:] if argv is None else argv
    return args[1:] if args[:1] == ["bench"] else args  # run as `twinshard bench ...`


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def plot(summary: dict, path: str, title: str) -> None:
    """Step time (with quartiles) and peak memory of each implementation, side by side."""
    names = list(summary)
    steps = [summary[n]["step_s"] * 1000 for n in names]
    err = [
        [s - summary[n]["step_q1_s"] * 1000 for s, n in zip(steps, names)],
        [summary[n]["step_q3_s"] * 1000 - s for s, n in zip(steps, names)],
    ]
    peaks = [
        summary[n].get("accelerator_peak", summary[n].get("memory_total", 0)) / MiB for n in names
    ]
    with figure(path, 110, 1, 2, figsize=(9, 3.2)) as (fig, (ax1, ax2)):
        ax1.bar(names, steps, yerr=err, color="#4c72b0", capsize=3)
        ax1.set_ylabel("step time (ms), median and quartiles")
        ax2.bar(names, peaks, color="#dd8452")
        ax2.set_ylabel("peak memory (MB)")
        for ax in (ax1, ax2):
            ax.tick_params(axis="x", rotation=30)
        fig.suptitle(title, fontsize=9)
