"""Gradients of parameters this rank did not use: kept where another rank used them, dropped
where none did, and the misuse named at the root's next forward or optimizer step.

Every trainable parameter of a group takes part in every reduction, with zeros from the ranks
that did not use it (``reference/more/usage.py`` says why). The reduced block is then the
exact gradient on every rank, and every rank adds it to the sharded gradient, so that after
any backward all ranks hold a gradient for a parameter or none does; a rank that kept only the
gradients it computed would leave the others with half a parameter's gradient, and the next
collective over them (``full_tensor()``, a norm for clipping) would hang.

One case needs the other ranks' word: a parameter that this rank did not use and that had no
gradient yet. If no rank used it, torch's FSDP2 leaves its gradient None (unless
``set_reduce_scatter_unused_params(True)``), and so must we, or an optimizer would decay and
move a parameter that took no part. ``note_reduced`` marks such a gradient as made of other
ranks' sums alone; at the end of the backward the root reads the tally of that backward over
the store (``usage.py``: no collective, no device value read; only a rank that has such a
gradient waits for it, and a step with no unused parameter waits for nobody) and ``drop``
removes the gradients that no rank's use justified.

A parameter used on some ranks but not all is the user's business to declare
(``set_reduce_scatter_unused_params(True)``, for routing). Undeclared, it is named by an
``FSDPUsageError`` on every rank at the same point: the root's next forward, or the next step of
any ``torch.optim`` optimizer, whichever comes first (``defer``: the settling waits until then
so that a rank with nothing unused never waits at the end of backward). The gradients are
exact and consistent by then; the error says the user did not say so.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from twinshard.api import FSDPUsageError

from . import channel
from .usage import mesh_ranks, post_unused

_made_of_others: weakref.WeakSet = weakref.WeakSet()  # ShardedParams: see ``note_reduced``
_unsettled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # root -> its settling
_optimizer_hook = None


def note_reduced(param, used_here: bool) -> None:
    """Call just before adding a reduced block to ``param``'s sharded gradient (a
    ``ShardedParam``): where this rank computed no gradient for it (``used_here`` false: not
    used, and not declared with ``set_reduce_scatter_unused_params(True)``) and it holds none
    yet, the gradient about to be made stands only if another rank used the parameter."""
    if not used_here and param.sharded_param.grad is None:
        _made_of_others.add(param)


def made_of_others(params) -> list:
    """Those of ``params`` whose gradient, made in this backward, holds other ranks' sums alone."""
    return [p for p in params if p in _made_of_others] if _made_of_others else []


def drop(params, unused_everywhere: set[str]) -> None:
    """Settle ``params`` (from ``made_of_others``): a gradient of a parameter that no rank used
    (its full name in ``unused_everywhere``) goes, as torch's FSDP2 never makes one; the others
    stay, the exact sums they are."""
    for p in params:
        _made_of_others.discard(p)
        if p.fqn in unused_everywhere:
            p.sharded_param.grad = None


def defer(root, settle: Callable[[], None]) -> None:
    """Run ``settle`` (which may raise) at ``root``'s next forward or the next optimizer step,
    whichever comes first, once."""
    global _optimizer_hook
    _unsettled[root] = settle
    if _optimizer_hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _optimizer_hook = register_optimizer_step_pre_hook(lambda *_: settle_all())


def settle(root) -> None:
    """Run ``root``'s deferred settling, if any (its forward is starting)."""
    pending = _unsettled.pop(root, None) if _unsettled else None
    if pending is not None:
        pending()


def settle_all() -> None:
    """Run every root's deferred settling (an optimizer is about to step)."""
    for root in list(_unsettled.keys()):
        settle(root)


def end_of_backward(root, groups: list) -> None:
    """End of ``root``'s backward (``groups``: its parameter groups, each with the ``usage`` of
    this backward, ``reduce_unused`` and ``params``, each on its ``info.mesh``): post which
    parameters this rank used, settle the gradients made of other ranks' sums alone, and leave the report of
    parameters used on some ranks only for the next forward or optimizer step."""
    settle(root)  # a backward before this one with no forward since
    by_mesh: dict[tuple, tuple] = {}  # parameters on the same ranks share one tally
    for group in groups:  # (a parameter may have a mesh of its own: ShardPlacementResult)
        for p in group.params if group.usage and not group.reduce_unused else ():
            mesh = p.info.mesh
            by_mesh.setdefault(mesh_ranks(mesh), (mesh, []))[1].append((p, group.usage.get(p)))
    posts = []
    for mesh, params in by_mesh.values():
        unused = [p.fqn for p, used in params if used is False]
        posted = post_unused(root, mesh, unused)
        others = made_of_others(p for p, _ in params)
        if posted is None:  # nobody to ask: what this rank left unused, every rank did
            drop(others, set(unused))
            continue
        if others or channel.debug:
            drop(others, posted.read()[1])
        posts.append((posted, mesh.size()))
    for group in groups:
        group.usage.clear()
    if posts:
        defer(root, lambda: report_partly_used(posts))
        if channel.debug:
            settle(root)


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
