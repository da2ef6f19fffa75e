"""The data of the site's schedule explorer: recorded steps over a grid of settings, as JSON.

A part of the docs build, not of the package: ``explorer.py`` (the hook beside it) calls it.
The explorer (``docs/explorer.md``, drawn by ``docs/js/explorer.js``) lets a student pick an
implementation, a world size, ``reshard_after_forward``, a prefetch depth and the parameters'
dtype, and step through the schedule of one training step that the code really ran with
those settings. This module makes what it shows:

- ``AXES`` declares the grid, ``grid(axes)`` is every combination of it (a ``Setting`` each);
- ``record_grid(settings)`` records each setting's step with ``record_on_rank``, the
  example job that ``twinshard schedule`` runs (``Setting.command`` is that command line),
  and keeps rank 0's schedule as the command does. The settings of one world size share one
  launch of gloo ranks on the CPU, recorded one after the other (starting ranks is what costs:
  seconds a launch, against under a second a recording). A setting that cannot be recorded
  raises ``RecordingFailed`` naming it;
- ``page_data(recorded, axes)`` turns the schedules into the page's JSON, and refuses a grid
  with a combination missing. Every number the page shows is computed here: per event the
  state of every group and the bytes of unsharded parameters and of gradient buffers as the
  recorder has them; per collective what it carried and when its result was read; per
  schedule the totals by op (``text.totals``' numbers), the peaks and what was unsharded or
  being gathered there. The browser only draws and steps.

``explorer.py`` calls both at build time and caches the JSON.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from twinshard.measure import grid as jobs_grid
from twinshard.measure.schedule.cli import example, record_on_rank
from twinshard.measure.schedule.steps import Schedule, name_of
from twinshard.measure.schedule.text import used_in
from twinshard.measure.units import human_bytes

HERE = os.path.dirname(os.path.abspath(__file__))

# Each axis of the grid: its values, in the order the page offers them.
AXES = {
    "impl": ("reference", "optimized", "torch"),
    "world": (2, 4),
    "reshard": (True, False),  # reshard_after_forward of the blocks
    "prefetch": (1, 2),  # explicit prefetch lists of this many blocks (``step.prefetch``)
    "dtype": ("fp32", "bf16"),  # bf16: bf16 parameters, gradients reduced in fp32
}
# Two settings set side by side: the same choices but for one axis, which takes both values.
COMPARISONS = (
    ("reference vs optimized", "impl", "reference", "optimized"),
    ("one vs two ahead", "prefetch", 1, 2),
    ("reshard true vs false", "reshard", True, False),
    ("fp32 vs bf16", "dtype", "fp32", "bf16"),
)
OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")  # the legend's order


class RecordingFailed(RuntimeError):
    """A setting of the explorer's grid could not be recorded; the message names it."""


@dataclass(frozen=True)
class Setting:
    """One point of the grid: the example job's policies for one recorded step."""

    impl: str
    world: int
    reshard: bool
    prefetch: int
    dtype: str

    @property
    def key(self) -> str:
        """How the page finds it: the values in ``AXES``' order, 'optimized|2|true|1|fp32'."""
        return "|".join(str(v).lower() for v in asdict(self).values())

    @property
    def label(self) -> str:
        ahead = {1: "one", 2: "two"}.get(self.prefetch, str(self.prefetch))
        return (
            f"{self.impl} on {self.world} ranks, reshard_after_forward={self.reshard}, "
            f"prefetch {ahead} ahead, {self.dtype} parameters"
        )

    def policies(self) -> dict:
        """``cli.example``'s keywords for this setting."""
        low = self.dtype != "fp32"
        return dict(
            reshard_after_forward=self.reshard,
            prefetch=self.prefetch,
            param_dtype=self.dtype if low else None,
            reduce_dtype="fp32" if low else None,
        )

    def command(self) -> str:
        """The ``twinshard schedule`` command that prints this setting's table."""
        words = f"twinshard schedule --impls {self.impl} --world {self.world}"
        words += f" --reshard-after-forward {str(self.reshard).lower()} --prefetch {self.prefetch}"
        if self.dtype != "fp32":
            words += f" --param-dtype {self.dtype} --reduce-dtype fp32"
        return words


def grid(axes: dict = AXES) -> list[Setting]:
    """Every combination of ``axes`` (``AXES``' keys, each with its values)."""
    return [Setting(**point) for point in jobs_grid.points(axes)]


# --- recording --------------------------------------------------------------------------------
def _record_on_rank(settings: list[Setting]) -> list[Schedule]:
    """On every rank of one launch: each setting's step in turn; rank 0 returns its records."""
    found = []
    for s in settings:
        try:
            found.append(record_on_rank(s.impl, **s.policies()))
        except Exception as error:
            raise RuntimeError(f"recording [{s.label}] failed: {error}") from error
    return found if dist.get_rank() == 0 else []


def record_grid(settings: list[Setting], timeout: float = 600) -> dict[Setting, Schedule]:
    """Rank 0's schedule of each setting, recorded on gloo ranks on this machine, one launch
    per world size. ``RecordingFailed`` names the first setting whose job is wrong (checked
    before any rank starts, with ``Job.problem``) or that failed on a rank."""
    from twinshard.ranks.launch import LaunchError, launch

    for s in settings:
        wrong = example(s.impl, s.world, **s.policies()).problem()
        if wrong:
            raise RecordingFailed(f"the explorer cannot record {s.label}: {wrong}")
    # Forking skips re-importing torch in every rank, as ``record_step`` does; a spawned rank
    # (where there is CUDA) imports this module by name, from the path it is given here.
    start = None if torch.cuda.is_available() else "fork"
    recorded = {}
    sys.path.insert(0, HERE)
    try:
        for world in sorted({s.world for s in settings}):
            batch = [s for s in settings if s.world == world]
            try:
                ranks = launch(_record_on_rank, world, batch, start_method=start, timeout=timeout)
            except LaunchError as error:
                named = [s.label for s in batch if f"[{s.label}]" in str(error)]
                which = named[0] if named else "one of: " + "; ".join(s.label for s in batch)
                raise RecordingFailed(f"the explorer failed to record {which}\n{error}") from None
            recorded.update(zip(batch, ranks[0]))
    finally:
        sys.path.remove(HERE)
    return recorded


# --- the page's JSON --------------------------------------------------------------------------
def page_data(recorded: dict[Setting, Schedule], axes: dict = AXES) -> dict:
    """The explorer's JSON for ``recorded`` schedules, which must cover every combination of
    ``axes`` (``ValueError`` naming the first one missing)."""
    missing = [s for s in grid(axes) if s not in recorded]
    if missing:
        raise ValueError(f"the explorer's grid has no recording of {missing[0].label}")
    return {
        "axes": {name: list(values) for name, values in axes.items()},
        "comparisons": [
            {"name": name, "axis": axis, "a": a, "b": b}
            for name, axis, a, b in COMPARISONS
            if {a, b} <= set(axes.get(axis, ()))
        ],
        "ops": list(OPS),
        "schedules": {s.key: schedule_data(s, recorded[s]) for s in grid(axes)},
    }


def schedule_data(setting: Setting, schedule: Schedule) -> dict:
    """One recorded step as the page draws it (see ``page_data``)."""
    groups = [name_of(g) for g in schedule.groups]
    events = [
        {
            "hook": e.hook,
            "group": name_of(e.group),
            "phase": e.phase,
            "states": "".join(schedule.group_state(e, g) for g in schedule.groups),
            "unsharded": e.unsharded_bytes,
            "grads": e.grad_bytes,
            "unsharded_size": human_bytes(e.unsharded_bytes),
            "grads_size": human_bytes(e.grad_bytes),
            "collectives": list(e.collectives),
        }
        for e in schedule.events
    ]
    return {
        "label": setting.label,
        "command": setting.command(),
        "impl": schedule.impl,
        "rank": schedule.rank,
        "world": schedule.world_size,
        "groups": groups,
        "events": events,
        "collectives": [collective_data(schedule, c) for c in schedule.collectives],
        "totals": totals_data(schedule),
        "peaks": {
            "unsharded": peak_data(schedule, lambda e: e.unsharded_bytes),
            "with_grads": peak_data(schedule, lambda e: e.unsharded_bytes + e.grad_bytes),
        },
    }


def collective_data(schedule: Schedule, c) -> dict:
    """What the table's line under its hook says of one collective, as fields."""
    if c.bookkeeping:
        carries = "a count of who had gradients (no parameters)"
    elif c.group is None:
        carries = "?"
    elif len(c.params) == len(schedule.params[c.group]) > 1:
        carries = f"{name_of(c.group)} ({len(c.params)} params)"
    else:
        carries = f"{name_of(c.group)}: {', '.join(c.params)}"
    read = used_in(schedule, c)
    return {
        "op": c.op,
        "dtype": c.dtype,
        "bytes": c.nbytes,
        "size": human_bytes(c.nbytes),
        "ranks": c.ranks,
        "blocking": c.blocking,
        "group": None if c.group is None else name_of(c.group),
        "carries": carries,
        "event": c.event,  # None: issued after the last hook
        # the hook during which its result was first read; len(events): after the step
        "used_in": read,
    }


def totals_data(schedule: Schedule) -> dict:
    """Collectives by op (count and bytes, ops that ran only) and in all."""
    by_op = []
    for op in OPS:
        calls = schedule.calls(op)
        if calls:
            n = sum(c.nbytes for c in calls)
            by_op.append({"op": op, "count": len(calls), "bytes": n, "size": human_bytes(n)})
    n = sum(c.nbytes for c in schedule.collectives)
    return {"by_op": by_op, "count": len(schedule.collectives), "bytes": n, "size": human_bytes(n)}


def in_flight(schedule: Schedule, index: int) -> list[str]:
    """The groups whose all-gather was issued by event ``index`` and not yet read by then."""
    found = []
    for c in schedule.calls("all_gather"):
        read = used_in(schedule, c)
        if c.event is not None and c.event <= index and (read is None or read > index):
            if c.group is not None and name_of(c.group) not in found:
                found.append(name_of(c.group))
    return found


def peak_data(schedule: Schedule, measure) -> dict:
    """The first event where ``measure`` is largest, and what it holds there: the groups
    unsharded (state U) and those whose all-gather is in flight."""
    if not schedule.events:
        return {"bytes": 0, "size": human_bytes(0), "event": None, "unsharded": [], "gathering": []}
    e = max(schedule.events, key=lambda e: (measure(e), -e.index))
    return {
        "bytes": measure(e),
        "size": human_bytes(measure(e)),
        "event": e.index,
        "hook": e.hook,
        "group": name_of(e.group),
        "unsharded": [name_of(g) for g in schedule.unsharded_groups(e)],
        "gathering": in_flight(schedule, e.index),
    }
