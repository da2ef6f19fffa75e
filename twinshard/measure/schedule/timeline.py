"""The schedule as a picture: one row per group, time running left to right.

For each group (module) there is a bar wherever its parameters are unsharded (hatched where
it keeps a post-forward piece), a triangle where a collective carrying its parameters or
gradients is issued, and, for an asynchronous collective, a dotted line to the circle where
its result was first read (the caller had to wait for it there at the latest). A blocking
collective is a filled marker: it was waited for on the spot. Every kind of collective drawn
has its own marker, is in the legend and is counted in the title (on gloo the optimized path
all-reduces packed gradients where an accelerator reduce-scatters them: the title says
"0 reduce-scatters" and the squares are those all-reduces). Integer collectives that carry no
parameter (bookkeeping) are not drawn; the title counts them apart. Under the rows, the bytes
alive in unsharded parameters, in gradient buffers and in the sharded parameters and
gradients, and on an accelerator everything its allocator holds.

Time is counted in operators, not seconds: every torch operator the step runs, every
collective and every hook moves it on by one. That makes a picture that is the same on any
machine, in which a block's compute is about as wide as its work, so an all-gather issued
one block ahead is seen to span that block's compute. Put several schedules in one call and
they are drawn one above the other, to be read side by side.
"""

from __future__ import annotations

from collections import Counter

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
OTHER = ("x", "black")  # any other op (all_to_all, a user's own)
MEMORY = (  # Event field -> (label, colour, line style)
    ("unsharded_bytes", "unsharded parameters", "tab:blue", "-"),
    ("grad_bytes", "gradient buffers", "tab:orange", "-"),
    ("sharded_bytes", "sharded parameters and gradients", "tab:grey", "--"),
    ("device_bytes", "all the accelerator holds", "black", ":"),
)
FONT = {"title": 11, "legend": 10, "label": 10, "tick": 9}


def drawn(schedule: Schedule) -> list:
    """The collectives the picture draws: those that carry a group's parameters or gradients."""
    return [c for c in schedule.collectives if c.group in schedule.groups]


def spelled(op: str, count: int) -> str:
    """'1 all-gather', '4 reduce-scatters'."""
    name = op.replace("_", "-")
    return f"{count} {name}{'' if count == 1 else 's'}"


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
        marker, colour = STYLE.get(c.op, OTHER)
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
        ax.text(backward[0], -0.75, "backward", fontsize=FONT["label"], color="0.35")
    ax.text(0, -0.75, "forward", fontsize=FONT["label"], color="0.35")
    ax.set_yticks(range(len(rows)), [name_of(g) for g in rows], fontsize=FONT["tick"])
    ax.set_ylim(len(rows) - 0.4, -1)
    ax.tick_params(axis="x", labelbottom=False)


def _draw_memory(ax, schedule: Schedule) -> None:
    ticks = [e.tick for e in schedule.events]
    for field, label, colour, style in MEMORY:
        values = [getattr(e, field) for e in schedule.events]
        if any(v is None for v in values) or not any(values):
            continue  # not recorded here (a CPU run has no allocator to ask)
        kib = [v / 1024.0 for v in values]
        ax.step(ticks, kib, where="post", color=colour, linestyle=style, label=label)
    ax.set_ylabel("KiB", fontsize=FONT["label"])
    ax.set_xlabel(
        "time, counted in operators (each torch operator, collective and hook is one step)",
        fontsize=FONT["label"],
    )
    ax.tick_params(labelsize=FONT["tick"])


def _title(schedule: Schedule) -> str:
    """What the picture shows, counted: every op drawn (all-gathers and reduce-scatters even
    when there are none), how many were blocking, and the bookkeeping left out."""
    shown = drawn(schedule)
    counts = Counter(c.op for c in shown)
    ops = ["all_gather", "reduce_scatter"] + sorted(set(counts) - {"all_gather", "reduce_scatter"})
    blocking = sum(c.blocking for c in shown)
    left_out = len(schedule.collectives) - len(shown)
    aside = f"; {left_out} bookkeeping, not drawn" if left_out else ""
    return (
        f"{schedule.impl or 'FSDP'} (rank {schedule.rank} of {schedule.world_size}): "
        f"{', '.join(spelled(op, counts[op]) for op in ops)}; {blocking} of them blocking{aside}"
    )


def _legend(schedules: list[Schedule]) -> list:
    """One entry for each thing drawn: the bars, the hooks, every kind of collective that some
    schedule has, how an asynchronous one is drawn, and the memory lines."""
    ops = sorted({c.op for s in schedules for c in drawn(s)}, key=lambda op: (op not in STYLE, op))
    first = STYLE.get(ops[0], OTHER) if ops else STYLE["all_gather"]
    handles = [
        Patch(color="tab:blue", alpha=0.25, label="unsharded"),
        Patch(facecolor="none", edgecolor="grey", hatch="///", label="post-forward piece"),
        Line2D([], [], marker="|", color="0.4", linestyle="none", markersize=10, label="hook ran"),
    ]
    for op in ops:
        marker, colour = STYLE.get(op, OTHER)
        name = op.replace("_", "-")
        handles.append(
            Line2D(
                [], [], marker=marker, color=colour, linestyle="none", label=f"{name} (blocking)"
            )
        )
    if any(not c.blocking for s in schedules for c in drawn(s)):
        hollow = dict(marker=first[0], color=first[1], markerfacecolor="white", linestyle=":")
        handles.append(Line2D([], [], label="async: issued (hollow) ...", **hollow))
        read = dict(marker="o", color=first[1], linestyle="none", markersize=5)
        handles.append(Line2D([], [], label="... result first read", **read))
    for field, label, colour, style in MEMORY:
        values = [getattr(e, field) for s in schedules for e in s.events]
        if values and all(v is not None for v in values) and any(values):
            handles.append(Line2D([], [], color=colour, linestyle=style, label=f"bytes: {label}"))
    return handles


def plot_timeline(
    schedules: list[Schedule] | Schedule, path: str | None = None, width: float = 11.0
):
    """Draw one or more schedules, one above the other; save to ``path`` if given.

    Returns the matplotlib figure (a notebook shows it).
    """
    if isinstance(schedules, Schedule):
        schedules = [schedules]
    heights = [0.42 * (len(s.groups) + 1.5) + 1.6 for s in schedules]
    handles = _legend(schedules)
    columns = min(4, len(handles))
    legend_height = 0.3 * -(-len(handles) // columns) + 0.2
    fig = plt.figure(figsize=(width, sum(heights) + legend_height))
    parts = fig.subfigures(len(schedules) + 1, 1, height_ratios=heights + [legend_height])
    for s, part in zip(schedules, parts):
        rows, memory = part.subplots(2, 1, sharex=True, height_ratios=[len(s.groups) + 1.5, 1.6])
        end = max([e.tick for e in s.events] + [c.tick for c in s.collectives] + [0]) + 1
        rows.set_xlim(-1, end)
        _draw_rows(rows, s)
        _draw_memory(memory, s)
        rows.set_title(_title(s), fontsize=FONT["title"], loc="left")
        part.subplots_adjust(left=0.1, right=0.98, top=0.9, bottom=0.17, hspace=0.08)
    parts[-1].legend(
        handles=handles, loc="center", ncol=columns, fontsize=FONT["legend"], frameon=False
    )
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
