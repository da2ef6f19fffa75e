"""The plan as text and as a picture: implementations side by side.

``format_plan(rows)`` is the table ``twinshard plan`` prints (markdown, so that it pastes into
a results page): one column per implementation, memory at the peak by part, whether it fits
each named device, the step's time and where its communication was exposed, the job's ideal
step and the FSDP overhead over it, MFU, the ratios to torch's ``fully_shard``, then the
collectives by op and link. ``plot_plan(rows, path)``
draws each implementation's device memory through the step (one line, by replayed entry) with
its peak's parts as a bar beside it.
"""

from __future__ import annotations

from twinshard.measure.units import MB, GiB, MiB, figure, markdown_table, ms

from .profiles import DEVICES
from .trace import PARTS

PART_NAMES = {
    "sharded": "sharded parameters",
    "sharded_grad": "sharded gradients",
    "optimizer": "optimizer states",
    "params": "unwrapped parameters",
    "unsharded": "unsharded parameters",
    "grad": "unsharded gradients",
    "comm": "communication buffers",
    "fsdp_buffers": "other FSDP buffers",
    "activations": "activations, temporaries",
}


def describe(row: dict) -> str:
    c, m = row["config"], row["model"]
    replicas = c["replicas"]
    mesh = f"{replicas} x {c['world'] // replicas} (HSDP)" if replicas > 1 else "FSDP"
    return (
        f"{c['preset']}: {m['params'] / 1e9:.2f}B parameters, {m['layers']} blocks; "
        f"{c['world']} ranks, {mesh}; {c['per_rank']} x {c['seq']} tokens per rank; {c['dtype']}; "
        f"ac {c['ac']}; reshard_after_forward {c['reshard_after_forward']}; "
        f"offload {c['offload']}; {c['optimizer']}; {row['device']}; {row['network']}"
        + (f"; variants {c['variants']}" if c.get("variants") else "")
    )


def format_plan(rows: dict) -> str:
    """The markdown table of ``rows`` (implementation -> ``summary.summarize``'s dict)."""
    ok = {name: row for name, row in rows.items() if "error" not in row}
    lines = []
    for name, row in rows.items():
        if "error" in row:
            lines.append(f"{name}: failed\n{row['error']}")
    if not ok:
        return "\n".join(lines)
    failed = {r["time"]["ideal_error"] for r in ok.values() if "ideal_error" in r["time"]}
    lines += [f"ideal step: failed: {error}" for error in failed]
    first = next(iter(ok.values()))
    big = max(r["memory"]["peak_bytes"] for r in ok.values()) >= GiB
    unit, size = ("GiB", GiB) if big else ("MiB", MiB)
    lines += [describe(first), ""]
    names, rows = list(ok), []

    def add(label: str, value) -> None:
        rows.append([label, *(value(ok[n]) for n in names)])

    add(f"**peak device memory ({unit})**", lambda r: f"**{r['memory']['peak_bytes'] / size:.2f}**")
    for part in PARTS:
        if any(r["memory"]["parts"].get(part) for r in ok.values()):
            add(f"  {PART_NAMES[part]}", lambda r, p=part: f"{r['memory']['parts'][p] / size:.2f}")
    add("peak reached at", lambda r: r["memory"]["peak_at"])
    if all(r["memory"].get("allocator") for r in ok.values()):  # see measure/allocator.py
        add(f"**reserved peak ({unit})**", lambda r: f"**{_reserved(r, 'segments') / size:.2f}**")
        add(f"  with expandable segments ({unit})", lambda r: f"{_reserved(r) / size:.2f}")
        add("  reserved / allocated", lambda r: f"{_ratio(r):.3f}")
    for name, device in DEVICES.items():
        add(f"fits {name} ({device.capacity // GiB} GiB)", lambda r, n=name: _yes(r, n))  # reserved
    add(f"host peak ({unit})", lambda r: f"{r['memory']['host_peak_bytes'] / size:.2f}")
    add("**step time (ms)**", lambda r: f"**{ms(r['time']['step_s'])}**")
    add("  compute (ms)", lambda r: ms(r["time"]["compute_s"]))
    add("  communication (ms)", lambda r: ms(r["time"]["comm_s"]))
    add("  exposed communication (ms)", lambda r: ms(r["time"]["exposed_s"]))
    add("  most exposed at", _most_exposed)
    add("ideal step (ms)", lambda r: _in_ms(r, "ideal_s"))
    add("FSDP overhead (ms)", lambda r: _in_ms(r, "overhead_s"))
    add("tokens/s per rank", lambda r: f"{r['time']['tokens_per_s']:,.0f}")
    add("MFU", lambda r: "-" if r["time"]["mfu"] is None else f"{r['time']['mfu']:.1%}")
    if all("vs_torch" in r for r in ok.values()):
        add("step time / torch's", lambda r: f"{r['vs_torch']['step_time']:.3f}")
        add("peak memory / torch's", lambda r: f"{r['vs_torch']['peak_memory']:.3f}")
        add("FSDP overhead / torch's", lambda r: _ratio_of(r, "fsdp_overhead"))
    add("recorded in (s)", lambda r: f"{r['record_s']:.1f}")
    lines += [markdown_table(["per rank", *names], rows), ""]
    lines += ["Collectives per step (count, MB per rank, ms on the wire):", ""]
    for name, row in ok.items():
        for key, c in sorted(row["communication"].items()):
            lines.append(
                f"- {name}: {key}: {c['count']}, {c['bytes'] / MB:.1f} MB, {ms(c['seconds'], 2)} ms"
            )
    return "\n".join(lines)


def _in_ms(row: dict, key: str) -> str:
    t = row["time"]
    return ms(t[key]) if key in t else ("failed" if "ideal_error" in t else "-")


def _ratio_of(row: dict, key: str) -> str:
    value = row["vs_torch"].get(key)
    return "-" if value is None else f"{value:.3f}"


def _reserved(row: dict, mode: str = "expandable") -> int:
    return row["memory"]["allocator"][mode]["reserved_peak"]


def _ratio(row: dict) -> float:
    return row["memory"]["allocator"]["segments"]["reserved_per_allocated"]


def _yes(row: dict, name: str) -> str:
    return "yes" if row["memory"]["fits"][name] else "**no**"


def _most_exposed(row: dict) -> str:
    exposed = row["time"]["exposed_by_label_s"]
    if not exposed:
        return "-"
    label, seconds = next(iter(exposed.items()))
    return f"{label} ({ms(seconds, 2)} ms)"


def plot_plan(rows: dict, timelines: dict, path: str) -> None:
    """Device memory through the step per implementation, and the peak's parts."""
    ok = {n: r for n, r in rows.items() if "error" not in r}
    with figure(path, 100, 1, 2, figsize=(11, 4), width_ratios=(3, 1)) as (fig, (line, bars)):
        for name in ok:
            points = timelines.get(name) or []
            line.plot([p[0] for p in points], [p[1] / GiB for p in points], label=name)
        _shade_phases(line, timelines.get(next(iter(ok))) or [])
        line.set_xlabel(
            "recorded entry of the step (shaded, the first one's: backward, recompute, optimizer)"
        )
        line.set_ylabel("device memory (GiB)")
        line.legend(fontsize=8)
        bottom = [0.0] * len(ok)
        for part in PARTS:
            heights = [r["memory"]["parts"].get(part, 0) / GiB for r in ok.values()]
            if any(heights):
                bars.bar(list(ok), heights, bottom=bottom, label=PART_NAMES[part])
                bottom = [b + h for b, h in zip(bottom, heights)]
        bars.set_title("at the peak (GiB)", fontsize=9)
        bars.legend(fontsize=6)
        fig.suptitle(describe(next(iter(ok.values()))), fontsize=7, wrap=True)


PHASE_COLOURS = {"backward": "#dde8f5", "recompute": "#f5e6d3", "optimizer": "#e2f0d9"}


def _shade_phases(ax, points: list) -> None:
    """Shade the spans of ``points`` ((entry, bytes, label) samples) by the hook's kind, and
    mark where the peak was, with its label."""
    start = 0
    for i in range(1, len(points) + 1):
        kind = points[start][2].split()[0]
        if i == len(points) or points[i][2].split()[0] != kind:
            if kind in PHASE_COLOURS:
                ax.axvspan(points[start][0], points[i - 1][0], color=PHASE_COLOURS[kind], lw=0)
            start = i
    if points:
        top = max(points, key=lambda p: p[1])
        ax.annotate(top[2], (top[0], top[1] / GiB), fontsize=7, ha="center", va="bottom")


def plot_sweep(points: list[tuple], axis: str, path: str) -> None:
    """Step time, peak memory and MFU against the swept ``axis``, one line per
    implementation (``points``: (value, implementation -> row) in the sweep's order)."""
    panels = [
        ("step time (ms)", lambda r: r["time"]["step_s"] * 1e3),
        ("peak device memory (GiB)", lambda r: r["memory"]["peak_bytes"] / GiB),
        ("MFU", lambda r: r["time"]["mfu"] or 0.0),
    ]
    impls = list(dict.fromkeys(name for _, rows in points for name in rows))
    with figure(path, 100, 1, 3, figsize=(11, 3.2)) as (fig, axes):
        for ax, (title, value) in zip(axes, panels):
            for impl in impls:
                xs = [str(v) for v, rows in points if "error" not in rows.get(impl, {"error": 1})]
                ys = [value(rows[impl]) for v, rows in points if str(v) in xs and impl in rows]
                ax.plot(xs, ys, marker="o", label=impl)
            ax.set_xlabel(axis)
            ax.set_title(title, fontsize=9)
        axes[0].legend(fontsize=7)
