"""Second reading. Parameters used on some ranks only, and why that must not hang, crash or mix gradients.

With routing (mixture of experts) or a branch taken on one rank and not on another, a
parameter gets a gradient on some ranks only. If each rank reduce-scattered just the gradients
it has, the ranks would issue collectives of different sizes (gloo aborts the process), a
different number of them (a hang), or, worse, same-sized collectives of different parameters
(silently mixed gradients). So every trainable parameter of a group takes part in every
reduction, with zeros from the ranks that did not use it: the sums are then exact, because a
rank that did not use a parameter contributes nothing to its gradient.

Whether that is what the user meant is another question. After each backward the root tells
the other ranks of each mesh which parameters it had no gradient for, through the job's
key-value store rather than a collective (``twinshard.guard.usage``: on an accelerator a
collective of host counts fails, and reading device counts back would stall every step), and
learns the tally of the backward before. A parameter used on some ranks but not all is reported
by name, one backward late (in the same backward with ``TWINSHARD_DEBUG=1``), unless the user said
it is expected with ``set_reduce_scatter_unused_params(True)``; then nothing is tallied and the
zero-filled reduction is the result, as in torch's FSDP2.
"""

from __future__ import annotations

from twinshard.api import FSDPUsageError
from twinshard.guard import mesh_ranks, tally_unused


def check_usage(root, groups: list) -> None:
    """Post which parameters this rank used in ``root``'s backward (the root's state; ``groups``
    its ``ParamGroup``s); raise on every rank if the tally read back names one that had a
    gradient on some ranks but not all."""
    by_mesh: dict[tuple, list] = {}  # groups on the same ranks share one tally
    for group in groups:
        if group.usage and not group.reduce_unused:
            by_mesh.setdefault(mesh_ranks(group.info.mesh), []).append(group)
    partly, when = [], -1
    for mesh_groups in by_mesh.values():
        mesh = mesh_groups[0].info.mesh
        unused = [p.fqn for g in mesh_groups for p, used in g.usage.items() if not used]
        n, found = tally_unused(root, mesh, unused)
        partly += [(name, used, mesh.size()) for name, used in found]
        when = max(when, n)
    for group in groups:
        group.usage.clear()
    if partly:
        names = ", ".join(f"'{name}' ({n} of {w} ranks)" for name, n, w in partly[:5])
        raise FSDPUsageError(
            f"parameters used on some ranks only got gradients from those ranks alone "
            f"(backward {when} of these ranks): {names}; if that is expected (routing, "
            "branches), call set_reduce_scatter_unused_params(True) on the module for exact "
            "sums, else make every rank use them"
        )
