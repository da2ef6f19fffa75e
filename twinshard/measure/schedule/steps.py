"""What a recorded step is made of: plain data, so that it pickles from a rank to its parent.

A ``Schedule`` is one training step as one rank saw it: the ``Event`` of every hook that the
implementation ran (with the state of every parameter right after it) and the ``Collective``
of every c10d collective it issued, both in order. ``record.py`` fills them in; ``text.py``
and ``timeline.py`` read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

HOOKS = ("pre_forward", "post_forward", "pre_backward", "post_backward", "final_callback")


@dataclass
class Collective:
    """One collective as this rank issued it."""

    index: int
    op: str  # all_gather | reduce_scatter | all_reduce | broadcast
    dtype: str  # e.g. "float32"
    nbytes: int  # of the larger side: the gathered output, the reduce-scatter input
    ranks: int  # size of the process group it ran on
    blocking: bool  # the caller waited for it before going on (async_op=False)
    tick: int  # position in the step when issued
    used_tick: int | None = None  # when its result was first read (blocking: = tick)
    event: int | None = None  # the hook event during which it was issued
    group: str | None = None  # the sharded module whose parameters or gradients it carries
    params: tuple[str, ...] = ()  # which of them: one name, or all of the group's

    @property
    def bookkeeping(self) -> bool:
        """An integer collective: a count the implementation exchanges (twinshard's ranks
        count who had a gradient for each parameter after the backward), carrying no parameter
        or gradient, so it belongs to no group."""
        return "int" in self.dtype


@dataclass
class Event:
    """A hook of the implementation has just run; what things looked like right after."""

    index: int
    tick: int
    group: str  # module path of the sharded module ("" is the root)
    hook: str  # one of HOOKS
    phase: str  # forward | backward
    states: dict[str, dict[str, str]]  # group -> parameter -> "S" sharded, "U", "P", "-" freed
    unsharded_bytes: int
    grad_bytes: int
    collectives: list[int] = field(default_factory=list)  # issued during this hook
    sharded_bytes: int = 0  # this rank's shards of the parameters and of their gradients
    device_bytes: int | None = None  # all the accelerator holds (activations too); None: CPU


@dataclass
class Schedule:
    """One step: events and collectives in order. Plain data, so it pickles across ranks."""

    impl: str
    rank: int
    world_size: int
    groups: list[str]  # module paths of the sharded modules, in module order
    params: dict[str, list[str]]  # group -> its parameter names (relative to the module)
    events: list[Event]
    collectives: list[Collective]

    def group_state(self, event: Event, group: str) -> str:
        """One letter for a whole group: U, S, P, '-', or '*' when its parameters differ."""
        letters = set(event.states[group].values())
        return letters.pop() if len(letters) == 1 else "*"

    def unsharded_groups(self, event: Event) -> list[str]:
        return [g for g in self.groups if self.group_state(event, g) == "U"]

    def calls(self, op: str | None = None, group: str | None = None) -> list[Collective]:
        return [
            c
            for c in self.collectives
            if (op is None or c.op == op) and (group is None or c.group == group)
        ]

    def events_of(self, hook: str, group: str | None = None) -> list[Event]:
        return [e for e in self.events if e.hook == hook and (group is None or e.group == group)]


def name_of(path: str) -> str:
    """How a group is shown: its module path, or "root" for the top module."""
    return path or "root"
