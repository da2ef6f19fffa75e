"""The schedule as a text table that reads top to bottom, in a terminal or a notebook.

One row per hook, in the order the implementation ran them, with the state of every group
right after it (one column per group) and the bytes alive. Under each hook, one indented line
per collective it issued: what, how big, over how many ranks, for which group, and whether
the caller waited for it on the spot (blocking) or went on and needed the result later
(async: "used in #k" names the hook during which its result was first read).
"""

from __future__ import annotations

from twinshard.measure.units import human_bytes

from .steps import Collective, Schedule, name_of

LEGEND = (
    "states after each hook: U unsharded, S sharded (DTensor shard), "
    "P post-forward piece, - freed, * mixed"
)


def used_in(schedule: Schedule, c: Collective) -> int | None:
    """Index of the hook during which the collective's result was first read, if it was."""
    if c.used_tick is None:
        return None
    return next((e.index for e in schedule.events if e.tick > c.used_tick), len(schedule.events))


def describe(schedule: Schedule, c: Collective) -> str:
    """'all_gather float32 1.2 KiB 2 ranks -> blocks.1 (6 params) async, used in #7'."""
    target = "?" if c.group is None else name_of(c.group)
    if c.bookkeeping:
        target = "a count of who had gradients (no parameters)"
    if c.group is not None:
        everything = len(c.params) == len(schedule.params[c.group]) > 1
        target += f" ({len(c.params)} params)" if everything else f": {', '.join(c.params)}"
    if c.blocking:
        when = "blocking"
    else:
        k = used_in(schedule, c)
        when = (
            "async, not used in this step"
            if k is None
            else (
                f"async, used in #{k}" if k < len(schedule.events) else "async, used after the step"
            )
        )
    return (
        f"{c.op:14s} {c.dtype:8s} {human_bytes(c.nbytes):>9s}  {c.ranks} ranks  "
        f"-> {target}  [{when}]"
    )


def _lines(schedule: Schedule, indices: list[int], compact: bool) -> list[str]:
    """One line per collective; with ``compact``, a run of one-parameter collectives of the
    same kind for the same group (the reference's loop over parameters) becomes one line."""
    runs: list[list[Collective]] = []
    for c in (schedule.collectives[i] for i in indices):
        last = runs[-1][-1] if runs else None
        same = (
            last is not None
            and len(c.params) == len(last.params) == 1
            and (c.op, c.dtype, c.ranks, c.group, c.blocking)
            == (last.op, last.dtype, last.ranks, last.group, last.blocking)
        )
        if compact and same:
            runs[-1].append(c)
        else:
            runs.append([c])
    out = []
    for run in runs:
        if len(run) == 1:
            out.append(f"{'':7s}{describe(schedule, run[0])}")
            continue
        c = run[0]
        out.append(
            f"{'':7s}{c.op:14s} {c.dtype:8s} {human_bytes(sum(r.nbytes for r in run)):>9s}"
            f"  {c.ranks} ranks  -> {name_of(c.group)}: {len(run)} params, one "
            f"{c.op.replace('_', '-')} each  [{'blocking' if c.blocking else 'async'}]"
        )
    return out


def format_table(schedule: Schedule, collectives: bool = True, compact: bool = False) -> str:
    """The whole step as text; ``collectives=False`` keeps only the hook rows, and
    ``compact=True`` writes a run of per-parameter collectives as one line."""
    names = [name_of(g) for g in schedule.groups]
    widths = [max(len(n), 4) for n in names]
    head = (
        f"{'#':>3s}  {'hook':15s} {'group':10s}  "
        + "  ".join(n.center(w) for n, w in zip(names, widths))
        + f"  {'unsharded':>10s}  {'grads':>10s}"
    )
    lines = [
        f"{schedule.impl or 'FSDP'}, rank {schedule.rank} of {schedule.world_size}: "
        f"one training step, {len(schedule.events)} hooks, "
        f"{len(schedule.collectives)} collectives",
        LEGEND,
        "",
        head,
    ]
    phase = None
    for e in schedule.events:
        if e.phase != phase:
            phase = e.phase
            lines.append(f"{'-' * 8} {phase} {'-' * (len(head) - len(phase) - 10)}")
        letters = [schedule.group_state(e, g).center(w) for g, w in zip(schedule.groups, widths)]
        lines.append(
            f"{e.index:3d}  {e.hook:15s} {name_of(e.group):10s}  "
            + "  ".join(letters)
            + f"  {human_bytes(e.unsharded_bytes):>10s}  {human_bytes(e.grad_bytes):>10s}"
        )
        if collectives:
            lines += _lines(schedule, e.collectives, compact)
    late = [c for c in schedule.collectives if c.event is None]
    if late:
        lines.append("after the last hook:")
        lines += [f"{'':7s}{describe(schedule, c)}" for c in late]
    lines.append(totals(schedule))
    return "\n".join(lines)


def totals(schedule: Schedule) -> str:
    """One summary line: how many collectives of each kind, how many bytes."""
    parts = []
    for op in ("all_gather", "reduce_scatter", "all_reduce", "broadcast"):
        calls = schedule.calls(op)
        if calls:
            parts.append(f"{len(calls)} {op} ({human_bytes(sum(c.nbytes for c in calls))})")
    peak = max((e.unsharded_bytes for e in schedule.events), default=0)
    return f"in all: {', '.join(parts) or 'no collectives'}; peak unsharded {human_bytes(peak)}"
