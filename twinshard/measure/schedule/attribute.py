"""Which parameter group a collective carries, worked out from the outside.

A collective knows only its tensors and its process group, so the recorder guesses the group
from what any implementation must send:

- sizes: every parameter of shape (rows, *rest) is padded to ``S * ceil(rows / S)`` rows for a
  shard group of S ranks. An all-gather's output and a reduce-scatter's input are therefore
  either one parameter's padded size (one collective per parameter, like the reference) or
  the sum over a group (one flat collective per group, like the optimized path and torch);
- values: an all-gather's input is this rank's shards of what it gathers. Its sum (in float64,
  after the same dtype cast) matches the sum of those shards and, with random weights, no
  other group's. That tells a prefetched group (the next block) from the one computing now,
  even when all blocks have the same shapes;
- context, to break the remaining ties (a LayerNorm weight of ones is the same in every
  block; gradients have no values known in advance): a parameter that already had this
  collective in this phase comes last; then the group whose hook is running; then the groups
  that run soonest after it (forward: module order; backward: the reverse).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor, Shard


def shard_size_of(t: DTensor) -> int:
    """How many pieces a sharded DTensor is cut into (mesh dimensions that shard it)."""
    size = 1
    for dim, placement in enumerate(t.placements):
        if isinstance(placement, Shard):
            size *= t.device_mesh.size(dim)
    return size


@dataclass
class ParamSizes:
    shard_size: int  # S
    per_rank: int  # ceil(rows / S) * rest: one rank's padded shard
    full: int  # S * per_rank: the padded whole parameter


class GroupInfo:
    """The modules of one ``fully_shard`` call and the parameters they manage: (name, owner
    module, attribute)."""

    def __init__(self, path: str, modules: list[nn.Module], owned: list):
        self.path, self.modules = path, modules
        self.params = [(name, owner, attr) for name, owner, attr, _ in owned]
        self.sizes: dict[str, ParamSizes] = {}
        for name, _, _, p in owned:
            S = shard_size_of(p)
            rows, rest = p.shape[0], p[0].numel() if p.dim() > 1 else 1
            per_rank = -(-rows // S) * rest
            self.sizes[name] = ParamSizes(S, per_rank, S * per_rank)

    @property
    def shard_size(self) -> int:
        return max((s.shard_size for s in self.sizes.values()), default=1)

    def numel(self, names, which: str) -> int:
        return sum(getattr(self.sizes[n], which) for n in names)


def _fingerprint(tensors: list[torch.Tensor]) -> tuple[float, float] | None:
    """Two sums of the values (None for ``FakeTensor``s, which have none: on the fake
    accelerator the sizes and the context alone attribute a collective)."""
    if any(isinstance(t, FakeTensor) for t in tensors):
        return None
    values = [t.detach().reshape(-1).double() for t in tensors]
    return (sum(float(v.sum()) for v in values), sum(float(v.abs().sum()) for v in values))


class Attributor:
    """Resolves each collective of one recorded step to a group (and its parameters)."""

    def __init__(self, groups: list[GroupInfo]):
        self.groups = groups
        # (group, name) -> this rank's shard: read before the step, or, for a parameter that
        # started the step unsharded (kept by set_reshard_after_backward(False)), as soon as
        # an all-gather might carry it, which it can only do once it is sharded again
        self.shards = {}
        self.owners = {}  # (group, name) -> (module, attribute)
        for g in groups:
            for name, owner, attr in g.params:
                self.owners[g.path, name] = (owner, attr)
                if isinstance(t := getattr(owner, attr), DTensor):
                    self.shards[g.path, name] = t.to_local()
        self.prints: dict = {}  # (group, name, dtype) -> fingerprint of its shard
        self.values: dict[int, tuple[float, float]] = {}  # all-gather -> its input's fingerprint
        self.numels: dict[int, int] = {}
        self.done: set = set()  # (op, phase, group, name): parameters already carried

    def note_values(self, c, inputs: list[torch.Tensor], numel: int) -> None:
        """At issue time: remember the collective's size and, for all-gathers, its input."""
        self.numels[c.index] = numel
        if c.op == "all_gather" and inputs and (values := _fingerprint(inputs)) is not None:
            self.values[c.index] = values
            for key, (owner, attr) in self.owners.items():
                if key not in self.shards and isinstance(t := getattr(owner, attr), DTensor):
                    self.shards[key] = t.to_local()

    def _shard_print(self, g: GroupInfo, names, dtype: torch.dtype):
        total = [0.0, 0.0]
        for n in names:
            key = (g.path, n, dtype)
            if key not in self.prints:
                shard = self.shards.get((g.path, n))
                if shard is None:  # not read yet: it may be, at a later all-gather
                    return None
                self.prints[key] = _fingerprint([shard.to(dtype)])
            if self.prints[key] is None:
                return None
            total = [total[0] + self.prints[key][0], total[1] + self.prints[key][1]]
        return tuple(total)

    def _candidates(self, c) -> list[tuple[GroupInfo, tuple[str, ...]]]:
        # An all-reduce carries a reduced block (HSDP, after the reduce-scatter) or, on gloo,
        # the whole gradients: [Note: reduce-scatter on gloo] in twinshard/optimized.
        numel = self.numels[c.index]
        sizes = ("per_rank", "full") if c.op == "all_reduce" else ("full",)
        found = []
        for g in self.groups:
            names = tuple(n for n, _, _ in g.params)
            for which in sizes:
                if len(names) > 1 and g.numel(names, which) == numel:
                    found.append((g, names))
                found += [(g, (n,)) for n in names if g.numel((n,), which) == numel]
        if c.index in self.values:
            dtype = getattr(torch, c.dtype)
            want = self.values[c.index]
            same = [
                (g, names)
                for g, names in found
                if (have := self._shard_print(g, names, dtype)) is not None
                and all(abs(a - b) <= 1e-9 * (1.0 + want[1]) for a, b in zip(have, want))
            ]
            found = same or found
        return found

    def resolve(self, c, hook_group: str, phase: str) -> None:
        """Fill in ``c.group`` and ``c.params`` (left empty when nothing fits)."""
        order = [g.path for g in self.groups]
        if phase == "backward":
            order.reverse()
        here = order.index(hook_group) if hook_group in order else 0

        def rank(candidate):
            g, names = candidate
            # a parameter already carried by this op in this phase is an unlikely match: a
            # group gathered whole cannot be one of its parameters' sizes again (an
            # all-gather of post-forward pieces has no shard values to tell them apart)
            again = any((c.op, phase, g.path, n) in self.done for n in names)
            return (again, g.path != hook_group, (order.index(g.path) - here) % len(order))

        found = sorted(self._candidates(c), key=rank)
        if found:
            g, names = found[0]
            self.done.update((c.op, phase, g.path, n) for n in names)
            c.group, c.params = g.path, names


def infer_post_forward_pieces(schedule, groups: dict[str, GroupInfo]) -> None:
    """Mark 'P' where a group kept a 1/N piece between forward and backward.

    With ``reshard_after_forward=N`` the reference keeps its piece out of sight (the module
    shows the usual sharded DTensor), but the backward all-gather gives it away: it runs over
    N ranks, not over the whole shard group. From the group's post_forward up to that
    all-gather, its parameters were pieces, not shards.
    """
    for path, g in groups.items():
        gathers = [
            c
            for c in schedule.collectives
            if c.group == path
            and c.op == "all_gather"
            and 0 < c.ranks < g.shard_size
            and c.event is not None
        ]
        for c in gathers:
            before = [
                e.index
                for e in schedule.events[: c.event]
                if e.group == path and e.hook == "post_forward"
            ]
            for e in schedule.events[before[-1] if before else c.event : c.event]:
                for name, letter in e.states[path].items():
                    if letter == "S":
                        e.states[path][name] = "P"
