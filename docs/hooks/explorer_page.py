"""What the site's schedule explorer shows, computed from the recordings, as JSON.

A part of the docs build: ``explorer.py`` (the hook beside it) calls ``page_data`` on what
``explorer_data.record_grid`` recorded. Every number the page shows is computed here; the
browser (``docs/js/explorer.js``) only draws and steps:

- per event, the state of every group (the recorder's letters, with **G** where the group is
  being gathered: an all-gather of it was issued and the group has not been unsharded since,
  so its buffer counts in memory while the parameters still show their shards; in flight on
  the optimized path, received and not yet copied out on torch's), this rank's shards (parameters and gradients), the bytes of unsharded
  parameters and of gradient buffers, and the bytes this rank sent during the hook;
- per collective what it carried, when its result was read, and the bytes one rank sends for
  it (``simnet.wire_bytes``: (N - 1) / N of its size for an all-gather or a reduce-scatter on
  a ring, twice that for an all-reduce), so that 2 and 4 ranks differ where they really do;
- per schedule the totals by op (``text.totals``' numbers and the bytes sent), this rank's
  parameter shards, the peaks and what was unsharded or being gathered there, and ``alike``:
  for each axis, the other values whose recording is this one's, event for event, with the
  reason (the page disables those controls and says why);
- the legend: only the ops and states that occur in some recording.
"""

from __future__ import annotations

import json

from explorer_data import COMPARISONS, Setting, grid

from twinshard.measure.schedule.steps import Schedule, name_of
from twinshard.measure.schedule.text import used_in
from twinshard.measure.simnet import wire_bytes
from twinshard.measure.units import human_bytes

OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")  # the legend's order
STATES = ("U", "G", "P", "S", "-", "*")  # the legend's order; G is added here (see above)


def page_data(recorded: dict[Setting, Schedule], axes: dict) -> dict:
    """The explorer's JSON for ``recorded`` schedules, which must cover every combination of
    ``axes`` (``ValueError`` naming the first one missing)."""
    missing = [s for s in grid(axes) if s not in recorded]
    if missing:
        raise ValueError(f"the explorer's grid has no recording of {missing[0].label}")
    schedules = {s: schedule_data(s, recorded[s]) for s in grid(axes)}
    for s, shown in schedules.items():
        shown["alike"] = alike(s, schedules, axes)
    seen_ops = {c["op"] for shown in schedules.values() for c in shown["collectives"]}
    seen_states = {x for shown in schedules.values() for e in shown["events"] for x in e["states"]}
    return {
        "axes": {name: list(values) for name, values in axes.items()},
        "comparisons": [
            {"name": name, "axis": axis, "a": a, "b": b}
            for name, axis, a, b in COMPARISONS
            if {a, b} <= set(axes.get(axis, ()))
        ],
        "ops": [op for op in OPS if op in seen_ops],
        "states": [x for x in STATES if x in seen_states],
        "schedules": {s.key: shown for s, shown in schedules.items()},
    }


def value_key(value) -> str:
    """A value of an axis as the page's keys spell it ('true', '2', 'fp32')."""
    return str(value).lower()


def alike(setting: Setting, schedules: dict[Setting, dict], axes: dict) -> dict:
    """For each axis, the other values whose step is this setting's, event for event and
    collective for collective: value -> why choosing it changes nothing."""
    mine = what_happened(schedules[setting])
    found = {}
    for axis, values in axes.items():
        for value in values:
            other = Setting(**{**setting.__dict__, axis: value})
            if other != setting and what_happened(schedules[other]) == mine:
                found.setdefault(axis, {})[value_key(value)] = why_alike(setting, axis, value)
    return found


def what_happened(shown: dict) -> str:
    """A schedule's recording without the words that name its setting."""
    return json.dumps([shown["events"], shown["collectives"], shown["groups"]], sort_keys=True)


def why_alike(setting: Setting, axis: str, value) -> str:
    """Why ``value`` on ``axis`` recorded the same step as ``setting``: the reason where the
    code gives one, else what the recording says."""
    if axis == "prefetch" and setting.impl == "reference":
        return (
            "the reference ignores prefetch lists: it has one stream and blocking "
            "collectives, so gathering early would overlap nothing"
        )
    if axis == "reshard" and {setting.reshard, value} == {True, setting.world}:
        return (
            f"on {setting.world} ranks, keeping a piece sharded over {setting.world} ranks is "
            "resharding fully, as true does"
        )
    return f"{axis} {value_key(value)} recorded the very same step as {value_key(getattr(setting, axis))}"


def schedule_data(setting: Setting, schedule: Schedule) -> dict:
    """One recorded step as the page draws it (see the module's docstring)."""
    groups = [name_of(g) for g in schedule.groups]
    collectives = [collective_data(schedule, c) for c in schedule.collectives]
    events = []
    for e, gathering in zip(schedule.events, being_gathered(schedule)):
        states = [schedule.group_state(e, g) for g in schedule.groups]
        states = ["G" if g in gathering else x for g, x in zip(schedule.groups, states)]
        sent = sum(collectives[k]["sent"] for k in e.collectives)
        events.append(
            {
                "hook": e.hook,
                "group": name_of(e.group),
                "phase": e.phase,
                "states": "".join(states),
                "sharded": e.sharded_bytes,
                "unsharded": e.unsharded_bytes,
                "grads": e.grad_bytes,
                "sent": sent,
                "sharded_size": human_bytes(e.sharded_bytes),
                "unsharded_size": human_bytes(e.unsharded_bytes),
                "grads_size": human_bytes(e.grad_bytes),
                "sent_size": human_bytes(sent),
                "collectives": list(e.collectives),
            }
        )
    # Before the first hook no gradient exists yet: what the rank holds is its parameters' shards.
    shards = schedule.events[0].sharded_bytes if schedule.events else 0
    # the memory lane's scale: the most this rank holds after a hook, shards included
    most = max(
        (e.sharded_bytes + e.unsharded_bytes + e.grad_bytes for e in schedule.events), default=0
    )
    return {
        "label": setting.label,
        "command": setting.command(),
        "impl": schedule.impl,
        "rank": schedule.rank,
        "world": schedule.world_size,
        "groups": groups,
        "events": events,
        "collectives": collectives,
        "totals": totals_data(collectives),
        "param_shards": shards,
        "param_shards_size": human_bytes(shards),
        "most_held": {"bytes": most, "size": human_bytes(most)},
        "peaks": {
            "unsharded": peak_data(schedule, events, lambda e: e.unsharded_bytes),
            "with_grads": peak_data(schedule, events, lambda e: e.unsharded_bytes + e.grad_bytes),
        },
    }


def collective_data(schedule: Schedule, c) -> dict:
    """What the table's line under its hook says of one collective, as fields, and the bytes
    this rank sends for it."""
    if c.bookkeeping:
        carries = "a count of who had gradients (no parameters)"
    elif c.group is None:
        carries = "?"
    elif len(c.params) == len(schedule.params[c.group]) > 1:
        carries = f"{name_of(c.group)} ({len(c.params)} params)"
    else:
        carries = f"{name_of(c.group)}: {', '.join(c.params)}"
    sent = round(wire_bytes(c.op, c.nbytes, c.ranks))
    return {
        "op": c.op,
        "dtype": c.dtype,
        "bytes": c.nbytes,
        "size": human_bytes(c.nbytes),
        "sent": sent,
        "sent_size": human_bytes(sent),
        "ranks": c.ranks,
        "blocking": c.blocking,
        "group": None if c.group is None else name_of(c.group),
        "carries": carries,
        "event": c.event,  # None: issued after the last hook
        # the hook during which its result was first read; len(events): after the step
        "used_in": used_in(schedule, c),
    }


def totals_data(collectives: list[dict]) -> dict:
    """Collectives by op (count, bytes, bytes this rank sent; ops that ran only) and in all."""

    def total(calls: list[dict]) -> dict:
        n, sent = sum(c["bytes"] for c in calls), sum(c["sent"] for c in calls)
        return {"count": len(calls), "bytes": n, "size": human_bytes(n)} | {
            "sent": sent,
            "sent_size": human_bytes(sent),
        }

    by_op = [
        {"op": op} | total(calls)
        for op in OPS
        if (calls := [c for c in collectives if c["op"] == op])
    ]
    return {"by_op": by_op} | total(collectives)


def being_gathered(schedule: Schedule) -> list[set[str]]:
    """Per event, the groups being gathered right after it: an all-gather of the group was
    issued during it or before, and the group has not been unsharded (U) since."""
    pending, found = set(), []
    for e in schedule.events:
        for k in e.collectives:
            c = schedule.collectives[k]
            if c.op == "all_gather" and c.group is not None and not c.bookkeeping:
                pending.add(c.group)
        pending -= {g for g in pending if schedule.group_state(e, g) == "U"}
        found.append(set(pending))
    return found


def peak_data(schedule: Schedule, events: list[dict], measure) -> dict:
    """The first event where ``measure`` is largest, and what it holds there: the groups
    unsharded (U) and those being gathered (G), as ``events`` (the page's) show them."""
    if not schedule.events:
        return {"bytes": 0, "size": human_bytes(0), "event": None, "unsharded": [], "gathering": []}
    e = max(schedule.events, key=lambda e: (measure(e), -e.index))
    states = events[e.index]["states"]
    return {
        "bytes": measure(e),
        "size": human_bytes(measure(e)),
        "event": e.index,
        "hook": e.hook,
        "group": name_of(e.group),
        "unsharded": [name_of(g) for g, x in zip(schedule.groups, states) if x == "U"],
        "gathering": [name_of(g) for g, x in zip(schedule.groups, states) if x == "G"],
    }
