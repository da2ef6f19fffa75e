"""Gradient cases: accumulation without sync, HSDP partial sums, clipping, divide factors.

Micro-batches with ``set_requires_gradient_sync(False)`` (all, root only, some blocks),
``set_reshard_after_backward`` and ``set_is_last_backward`` between them, HSDP's
``set_requires_all_reduce(False)`` over several micro-batches, ``clip_grad_norm_`` with the 1,
2 and inf norms, and ``set_gradient_divide_factor``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn

from twinshard.ranks.devices import backends_by_device

from .. import models as M
from .core import case, train_case


def _no_sync(select: Callable[[nn.Module], list[nn.Module]], recurse: bool = True):
    def on_micro(model, micro, last):
        for m in select(model):
            m.set_requires_gradient_sync(last, recurse=recurse)

    return on_micro


@case("gradients")
def case_no_sync_all(ctx):
    """Two micro-batches; set_requires_gradient_sync(False) on the root for the first."""
    recipe = M.mlp_recipe(ctx.world, micro=2, on_micro=_no_sync(lambda m: [m]))
    return train_case(ctx, recipe)


@case("gradients")
def case_no_sync_root_only(ctx):
    """Only the root skips the reduction (recurse=False); blocks reduce every micro-batch."""
    recipe = M.mlp_recipe(ctx.world, micro=2, on_micro=_no_sync(lambda m: [m], recurse=False))
    return train_case(ctx, recipe)


@case("gradients")
def case_no_sync_some(ctx):
    """Blocks 0 and 2 skip the reduction on the first micro-batch; the rest reduce."""
    select = lambda m: [m.blocks[0], m.blocks[2]]  # noqa: E731
    recipe = M.mlp_recipe(ctx.world, micro=2, on_micro=_no_sync(select, recurse=False))
    return train_case(ctx, recipe)


@case("gradients")
def case_reshard_after_backward_false(ctx):
    """set_reshard_after_backward(False) and set_is_last_backward(False) between
    micro-batches, without gradient sync."""

    def on_micro(model, micro, last):
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)
        model.set_is_last_backward(last)

    return train_case(ctx, M.mlp_recipe(ctx.world, micro=3, on_micro=on_micro))


@case(
    "gradients", needs=lambda ctx: ctx.hsdp, why="set_requires_all_reduce needs an HSDP (2D) mesh"
)
def case_no_all_reduce(ctx):
    """HSDP: set_requires_all_reduce(False) on the first two of three micro-batches, so the
    partial sums of two backwards must add up before the last one all-reduces them."""

    def on_micro(model, micro, last):
        model.set_requires_all_reduce(last)

    return train_case(ctx, M.mlp_recipe(ctx.world, micro=3, on_micro=on_micro))


@case("gradients")
def case_clip_norm_2(ctx):
    """clip_grad_norm_ with the 2-norm (clipping active: small max norm)."""
    return train_case(ctx, M.mlp_recipe(ctx.world, clip=0.05, norm_type=2.0))


@case("gradients")
def case_clip_norm_1(ctx):
    """clip_grad_norm_ with the 1-norm."""
    return train_case(ctx, M.mlp_recipe(ctx.world, clip=0.05, norm_type=1.0))


@case("gradients")
def case_clip_norm_inf(ctx):
    """clip_grad_norm_ with the inf-norm."""
    return train_case(ctx, M.mlp_recipe(ctx.world, clip=0.01, norm_type=float("inf")))


@case("gradients")
def case_gradient_divide_factor(ctx):
    """set_gradient_divide_factor(2 * world): gradients come out scaled by world / factor."""
    factor = 2.0 * ctx.world

    def wrap(impl, model, mesh):
        M.shard_blocks(impl, model, mesh)
        for m in model.modules():
            if isinstance(m, impl.FSDPModule):
                m.set_gradient_divide_factor(factor)

    def loss(model, batch):  # the plain model's gradient gets the same scale
        loss = M.mse(model, batch)
        if hasattr(model, "set_gradient_divide_factor"):
            return loss
        scale = ctx.world / factor
        return loss * scale + (loss - loss * scale).detach()  # value: loss; gradient: scaled

    gloo = backends_by_device().get(ctx.device_type) == "gloo"  # "cpu:gloo,cuda:nccl" too
    reason = "torch reduces with ReduceOp.PREMUL_SUM, which gloo lacks" if gloo else None
    return train_case(ctx, M.mlp_recipe(ctx.world, wrap=wrap, loss=loss), no_oracle=reason)
