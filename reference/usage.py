"""Parameters used on some ranks only, and why that must not hang, crash or mix gradients.

With routing (mixture of experts) or a branch taken on one rank and not on another, a
parameter gets a gradient on some ranks only. If each rank reduce-scattered just the gradients
it has, the ranks would issue collectives of different sizes (gloo aborts the process), a
different number of them (a hang), or, worse, same-sized collectives of different parameters
(silently mixed gradients). So every trainable parameter of a group takes part in every
reduction, with zeros from the ranks that did not use it: the sums are then exact, because a
rank that did not use a parameter contributes nothing to its gradient.

Whether that is what the user meant is another question. After each backward the root counts,
over the ranks, who had a gradient for each parameter (one small integer all-reduce per mesh).
A parameter used on some ranks but not all is reported by name, unless the user said it is
expected with ``set_reduce_scatter_unused_params(True)``; then nothing is counted and the
zero-filled reduction is the result, as in torch's FSDP2.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from twinshard.api import FSDPUsageError

from .param_group import ParamGroup


def check_usage(groups: list[ParamGroup]) -> None:
    """Raise on every rank if some parameter had a gradient on some ranks but not all."""
    by_mesh: dict[tuple, list] = {}  # groups on the same ranks share one count
    for group in groups:
        if group.usage and not group.reduce_unused:
            key = (id(group.info.shard_group), id(group.info.replicate_group))
            by_mesh.setdefault(key, []).append(group)
    partly = []
    for mesh_groups in by_mesh.values():
        info = mesh_groups[0].info
        world = info.shard_size * info.replicate_size
        params = [(p, used) for g in mesh_groups for p, used in g.usage.items()]
        if world > 1:
            counts = torch.tensor([int(used) for _, used in params], dtype=torch.int32)  # (P,)
            dist.all_reduce(counts, group=info.shard_group)
            if info.replicate_group is not None:
                dist.all_reduce(counts, group=info.replicate_group)
            partly += [(p, int(n), world) for (p, _), n in zip(params, counts) if 0 < n < world]
    for group in groups:
        group.usage.clear()
    if partly:
        names = ", ".join(f"'{p.fqn}' ({n} of {w} ranks)" for p, n, w in partly[:5])
        raise FSDPUsageError(
            f"parameters used on some ranks only got gradients from those ranks alone: {names}; "
            "if that is expected (routing, branches), call set_reduce_scatter_unused_params(True) "
            "on the module for exact sums, else make every rank use them"
        )
