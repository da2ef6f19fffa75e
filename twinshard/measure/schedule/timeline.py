"""The schedule as a picture: one row per group, time running left to right.

For each group (module) there is a bar wherever its parameters are unsharded (hatched where
it keeps a post-forward piece), a triangle where a collective carrying its parameters or
gradients is issued, and, for an asynchronous collective, a dotted line to the circle where
its result was first read (the caller had to wait for it there at the latest). A blocking
collective is a filled triangle: it was waited for on the spot. Under the rows, the bytes
alive in unsharded parameters and in gradient buffers.

Time is counted in operators, not seconds: every torch operator the step runs, every
collective and every hook moves it on by one. That makes a picture that is the same on any
machine, in which a block's compute is about as wide as its work, so an all-gather issued
one block ahead is seen to span that block's compute. Put several schedules in one call and
they are drawn one above the other, to be read side by side.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from .steps import Schedule, name_of

STYLE = {  # op -> (marker, colour)
    "all_gather": ("v", "tab:blue"),
    "reduce_scatter": ("^", "tab:orange"),
    "all_reduce": ("s", "tab:green"),
    "broadcast": ("D", "tab:purple"),
}


def _spans(schedule: Schedule, group: str, letter: str) -> list[tuple[float, float]]:
    """(start, width) of every stretch during which the group was in state ``letter``."""
    spans, start = [], None
    ticks = [e.tick for e in schedule.events]
    end = max([ticks[-1]] + [c.tick for c in schedule.collectives]) + 1 if ticks else 1
    for e in schedule.events:
        now = schedule.group_state(e, group) == letter
        if now and start is None:
            start = e.tick
        elif not now and start is not None:
            spans.append((start, e.tick - start))
            start = None
    if start is not None:
        spans.append((start, end - start))
    return spans


def _draw_rows(ax, schedule: Schedule) -> None:
    rows = {g: i for i, g in enumerate(schedule.groups)}
    for g, y in rows.items():
        ax.broken_barh(_spans(schedule, g, "U"), (y - 0.3, 0.6), color="tab:blue", alpha=0.25)
        ax.broken_barh(
            _spans(schedule, g, "P"),
            (y - 0.3, 0.6),
            facecolor="none",
            edgecolor="grey",
            hatch="///",
        )
    for e in schedule.events:
        if e.group in rows:
            ax.plot(e.tick, rows[e.group], marker="|", color="0.4", markersize=14)
    for c in schedule.collectives:
        if c.group not in rows:
            continue
        marker, colour = STYLE.get(c.op, ("x", "black"))
        y = rows[c.group]
        ax.plot(
            c.tick,
            y,
            marker=marker,
            markersize=8,
            color=colour,
            markerfacecolor=colour if c.blocking else "white",
        )
        if not c.blocking and c.used_tick is not None:
            ax.plot([c.tick, c.used_tick], [y, y], linestyle=":", color=colour)
            ax.plot(c.used_tick, y, marker="o", markersize=5, color=colour)
    backward = [e.tick for e in schedule.events if e.phase == "backward"]
    if backward:
        ax.axvspan(backward[0] - 0.5, ax.get_xlim()[1], color="0.93", zorder=0)
        ax.text(backward[0], -0.75, "backward", fontsize=8, color="0.35")
    ax.text(0, -0.75, "forward", fontsize=8, color="0.35")
    ax.set_yticks(range(len(rows)), [name_of(g) for g in rows])
    ax.set_ylim(len(rows) - 0.4, -1)
    ax.tick_params(axis="x", labelbottom=False)


def _draw_memory(ax, schedule: Schedule) -> None:
    ticks = [e.tick for e in schedule.events]
    kib = 1024.0
    ax.step(
        ticks,
        [e.unsharded_bytes / kib for e in schedule.events],
        where="post",
        color="tab:blue",
        label="unsharded parameters",
    )
    ax.step(
        ticks,
        [e.grad_bytes / kib for e in schedule.events],
        where="post",
        color="tab:orange",
        label="gradient buffers",
    )
    ax.set_ylabel("KiB", fontsize=8)
    ax.set_xlabel(
        "time, counted in operators (each torch operator, collective and hook is one step)",
        fontsize=8,
    )
    ax.tick_params(labelsize=7)


def _title(schedule: Schedule) -> str:
    gathers, reduces = len(schedule.calls("all_gather")), len(schedule.calls("reduce_scatter"))
    blocking = sum(c.blocking for c in schedule.collectives)
    return (
        f"{schedule.impl or 'FSDP'} (rank {schedule.rank} of {schedule.world_size}): "
        f"{gathers} all-gathers, {reduces} reduce-scatters, {blocking} of them blocking"
    )


def _legend() -> list:
    return [
        Patch(color="tab:blue", alpha=0.25, label="unsharded"),
        Patch(facecolor="none", edgecolor="grey", hatch="///", label="post-forward piece"),
        Line2D([], [], marker="|", color="0.4", linestyle="none", markersize=10, label="hook ran"),
        Line2D([], [], marker="v", color="tab:blue", linestyle="none", label="all-gather issued"),
        Line2D(
            [], [], marker="^", color="tab:orange", linestyle="none", label="reduce-scatter issued"
        ),
        Line2D(
            [],
            [],
            marker="v",
            color="tab:blue",
            markerfacecolor="white",
            linestyle=":",
            label="async: issued ... ",
        ),
        Line2D(
            [],
            [],
            marker="o",
            color="tab:blue",
            linestyle="none",
            markersize=5,
            label="... result first read",
        ),
        Line2D([], [], color="tab:blue", label="bytes: unsharded parameters"),
        Line2D([], [], color="tab:orange", label="bytes: gradient buffers"),
    ]


def plot_timeline(
    schedules: list[Schedule] | Schedule, path: str | None = None, width: float = 11.0
):
    """Draw one or more schedules, one above the other; save to ``path`` if given.

    Returns the matplotlib figure (a notebook shows it).
    """
    if isinstance(schedules, Schedule):
        schedules = [schedules]
    heights = [0.42 * (len(s.groups) + 1.5) + 1.4 for s in schedules]
    fig = plt.figure(figsize=(width, sum(heights) + 0.6))
    parts = fig.subfigures(len(schedules) + 1, 1, height_ratios=heights + [0.6])
    for s, part in zip(schedules, parts):
        rows, memory = part.subplots(2, 1, sharex=True, height_ratios=[len(s.groups) + 1.5, 1.6])
        end = max([e.tick for e in s.events] + [c.tick for c in s.collectives] + [0]) + 1
        rows.set_xlim(-1, end)
        _draw_rows(rows, s)
        _draw_memory(memory, s)
        rows.set_title(_title(s), fontsize=10, loc="left")
        part.subplots_adjust(left=0.1, right=0.98, top=0.9, bottom=0.17, hspace=0.08)
    parts[-1].legend(handles=_legend(), loc="center", ncol=5, fontsize=8, frameon=False)
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
