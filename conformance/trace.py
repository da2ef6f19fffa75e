"""The collective trace: every collective a rank issues, as (op, dtype, numel).

``CollectiveTrace`` is a ``TorchDispatchMode``. Every ``torch.distributed`` collective on
tensors reaches the dispatcher as a ``c10d`` operator (``twinshard.dispatch.c10d``'s table), whichever
implementation issued it and however it wrapped the call, so the trace sees torch's
``fully_shard`` exactly as it sees ours. A case records one training step and then checks that

- the traces of all ranks are the same sequence (a mismatch would hang a real run; here it
  is reported, with the first position where two ranks differ);
- all-gathers run in the parameter dtype and reduce-scatters / all-reduces in the reduce
  dtype that the policy asked for;
- the amount communicated matches the schedule: per step, each group is all-gathered once
  per unshard (its padded size) and reduce-scattered once (its padded size), issued either as
  one collective per group or as one per parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from twinshard.dispatch import c10d


@dataclass(frozen=True)
class Call:
    op: str  # all_gather | reduce_scatter | all_reduce | broadcast | all_to_all
    dtype: torch.dtype
    numel: int  # of the larger side: the gathered output / the reduce-scatter input


class CollectiveTrace(TorchDispatchMode):
    """Records the collectives issued while it is active (``with CollectiveTrace() as t``)."""

    def __init__(self):
        super().__init__()
        self.calls: list[Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (call := c10d.call(func, args, kwargs)) is not None:  # an exchange in place
            self.calls.append(Call(call.op, call.big.dtype, call.numel))  # is its all-gather
        return func(*args, **(kwargs or {}))


def compare_ranks(calls: list[Call]) -> str | None:
    """None if every rank recorded the same sequence, else where the first two differ."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, [(c.op, str(c.dtype), c.numel) for c in calls])
    for rank, other in enumerate(every[1:], 1):
        if other != every[0]:
            i = next(
                (k for k, (a, b) in enumerate(zip(every[0], other)) if a != b),
                min(len(every[0]), len(other)),
            )
            first = every[0][i] if i < len(every[0]) else "nothing"
            theirs = other[i] if i < len(other) else "nothing"
            return (
                f"rank 0 and rank {rank} differ at collective #{i}: {first} vs {theirs} "
                f"({len(every[0])} vs {len(other)} collectives)"
            )
    return None


def totals(calls: list[Call], op: str) -> tuple[int, int, set]:
    """(count, total numel, dtypes) of one kind of collective, parameters and gradients only:
    collectives of integers are bookkeeping (such as twinshard's count of which parameters got
    gradients), not part of the schedule."""
    mine = [c for c in calls if c.op == op and c.dtype not in (torch.int32, torch.int64)]
    return len(mine), sum(c.numel for c in mine), {c.dtype for c in mine}


def gloo_reduce_scatters(calls: list[Call]) -> list[Call]:
    """``calls`` with every floating-point all-reduce counted as the reduce-scatter it stands
    for. gloo has no reduce-scatter of its own: it all-reduces a copy of the whole input and
    keeps this rank's block, so an implementation may as well all-reduce its packed gradients
    in place (``twinshard.optimized`` does): the same sums and the same bytes on the wire. Use
    it for a gloo run without HSDP, where no other all-reduce of gradients belongs in a step."""
    return [
        Call("reduce_scatter", c.dtype, c.numel)
        if c.op == "all_reduce" and c.dtype.is_floating_point
        else c
        for c in calls
    ]


def padded_numel(param, shard_size: int) -> int:
    """Elements of a parameter once dim 0 is padded to a multiple of the shard group size."""
    rows = param.shape[0]
    per_row = param.numel() // rows if rows else 0
    return -(-rows // shard_size) * shard_size * per_row
