"""Second reading. Parameters used on some ranks only, and why that must not hang, crash or mix gradients.

With routing (mixture of experts) or a branch taken on one rank and not on another, a
parameter gets a gradient on some ranks only. If each rank reduce-scattered just the gradients
it has, the ranks would issue collectives of different sizes (gloo aborts the process), a
different number of them (a hang), or, worse, same-sized collectives of different parameters
(silently mixed gradients). So every trainable parameter of a group takes part in every
reduction, with zeros from the ranks that did not use it: the sums are then exact, because a
rank that did not use a parameter contributes nothing to its gradient.

Every rank then adds the reduced block to the sharded gradient, so that after any backward all
ranks hold a gradient for a parameter or none does. Where this rank did not use a parameter that
had no gradient yet, that gradient stands only if some rank used it: if none did, it is dropped,
as torch's FSDP2 makes none (``twinshard.guard.unused_grads``). To know, the ranks tell each
other which parameters they had no gradient for, through the job's key-value store rather than
a collective (``twinshard.guard.usage``: on an accelerator a collective of host counts fails,
and reading device counts back would stall every step). Only a rank holding such a gradient
reads the tally at the end of the backward; the others read it later.

Whether that is what the user meant is another question. A parameter used on some ranks but
not all is reported by name on every rank at the root's next forward or the next optimizer
step (in the same backward with ``TWINSHARD_DEBUG=1``), unless the user said it is expected
with ``set_reduce_scatter_unused_params(True)``; then nothing is tallied and the zero-filled
reduction is the result, as in torch's FSDP2.
"""

from __future__ import annotations

from twinshard.api import FSDPUsageError
from twinshard.guard import debug_enabled, mesh_ranks, post_unused, unused_grads


def check_usage(root, groups: list) -> None:
    """End of ``root``'s backward (the root's state; ``groups`` its ``ParamGroup``s): post which
    parameters this rank used, settle the gradients made of other ranks' sums alone, and leave
    the report of parameters used on some ranks only for the next forward or optimizer step."""
    unused_grads.settle(root)  # a backward before this one with no forward since
    by_mesh: dict[tuple, list] = {}  # groups on the same ranks share one tally
    for group in groups:
        if group.usage and not group.reduce_unused:
            by_mesh.setdefault(mesh_ranks(group.info.mesh), []).append(group)
    posts = []
    for mesh_groups in by_mesh.values():
        unused = [p.fqn for g in mesh_groups for p, used in g.usage.items() if not used]
        posted = post_unused(root, mesh_groups[0].info.mesh, unused)
        others = unused_grads.made_of_others(p for g in mesh_groups for p in g.params)
        if posted is None:  # nobody to ask: what this rank left unused, every rank did
            unused_grads.drop(others, set(unused))
            continue
        if others or debug_enabled():
            unused_grads.drop(others, posted.read()[1])
        posts.append((posted, mesh_groups[0].info.mesh.size()))
    for group in groups:
        group.usage.clear()
    if posts:
        unused_grads.defer(root, lambda: report_partly_used(posts))
        if debug_enabled():
            unused_grads.settle(root)


def report_partly_used(posts: list) -> None:
    """Raise on every rank if a tally (``posts``: each backward's post and its number of ranks)
    names a parameter that had a gradient on some ranks but not all."""
    partly = [(name, n, world, post.n) for post, world in posts for name, n in post.read()[0]]
    if partly:
        names = ", ".join(f"'{name}' ({n} of {w} ranks)" for name, n, w, _ in partly[:5])
        raise FSDPUsageError(
            f"parameters used on some ranks only (backward {partly[0][3]} of these ranks): "
            f"{names}; every rank has their exact gradients, summed with zeros from the ranks "
            "that did not use them; if that is expected (routing, branches), call "
            "set_reduce_scatter_unused_params(True) on the module, else make every rank use them"
        )
