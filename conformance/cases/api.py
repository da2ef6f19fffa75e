"""Cases of the explicit interface: offload, ``unshard``/``reshard``, forward methods, the
states parameters are in after forward and backward, and the scheduling hints.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.distributed.tensor import DTensor

from .. import models as M
from ..compare import Checker
from ..driver import run_sharded
from .core import case, train_case


@case("offload")
def case_cpu_offload(ctx):
    """CPUOffloadPolicy: shards, gradients and optimizer state on the CPU; same results."""

    def wrap(impl, model, mesh):
        M.shard_blocks(impl, model, mesh, offload_policy=impl.CPUOffloadPolicy(pin_memory=False))

    checker = train_case(ctx, M.mlp_recipe(ctx.world, wrap=wrap))
    keep_grads = M.mlp_recipe(ctx.world, wrap=wrap, steps=1, zero_grad_set_to_none=lambda s: False)
    trace, model = run_sharded(keep_grads, ctx.impl, ctx.mesh)
    for name, p in model.named_parameters():
        checker.count += 1
        if p.device.type != "cpu" or (p.grad is not None and p.grad.device.type != "cpu"):
            checker.fail(f"'{name}' or its gradient is not on the CPU under CPUOffloadPolicy")
        for key, value in trace.optimizer.state.get(p, {}).items():
            if torch.is_tensor(value) and value.dim() > 0 and value.device.type != "cpu":
                checker.fail(f"optimizer state '{key}' of '{name}' is not on the CPU")
    return checker


@case("api")
def case_explicit_unshard(ctx):
    """unshard() / unshard(async_op=True).wait() before forward, reshard() after the step."""

    def loss(model, batch):
        if hasattr(model, "unshard"):
            model.unshard()
            handle = model.blocks[1].unshard(async_op=True)
            if handle is not None:
                handle.wait()
        out = M.mse(model, batch)
        return out

    checker = train_case(ctx, replace(M.mlp_recipe(ctx.world), loss=loss))
    model = M.MLPStack()
    M.shard_blocks(ctx.impl, model, ctx.mesh)
    model.unshard()
    if isinstance(model.head.weight, DTensor):
        checker.fail("after unshard() the root's parameters should be plain (unsharded) tensors")
    model.reshard()
    if not isinstance(model.head.weight, DTensor):
        checker.fail("after reshard() the root's parameters should be sharded DTensors")
    return checker


@case("api")
def case_forward_method(ctx):
    """register_fsdp_forward_method: a method other than forward runs the FSDP hooks."""

    def wrap(impl, model, mesh):
        impl.fully_shard(model, mesh=mesh)
        impl.register_fsdp_forward_method(model, "score")

    recipe = M.mlp_recipe(ctx.world, wrap=wrap, loss=lambda m, b: m.score(*b))
    return train_case(ctx, replace(recipe, build=lambda: M.ScoreMLP()))


@case("api")
def case_reshard_states(ctx):
    """After forward: blocks resharded, the root kept unsharded; after backward: all sharded.
    With reshard_after_forward=False the blocks stay unsharded until after backward."""
    checker = Checker("fp32")
    for label, kwargs in (
        ("default", {}),
        ("reshard_after_forward=False", {"reshard_after_forward": False}),
    ):
        model = M.MLPStack()
        M.shard_blocks(ctx.impl, model, ctx.mesh, **kwargs)
        loss = model(torch.randn(4, 15)).pow(2).mean()
        block_sharded = isinstance(model.blocks[0].w1.weight, DTensor)
        expected = not kwargs
        checker.count += 3
        if block_sharded != expected:
            checker.fail(
                f"{label}: after forward a block is {'sharded' if block_sharded else 'unsharded'}"
            )
        if isinstance(model.head.weight, DTensor):
            checker.fail(f"{label}: the root should keep its parameters unsharded after forward")
        loss.backward()
        if not all(isinstance(p, DTensor) for p in model.parameters()):
            checker.fail(f"{label}: after backward every parameter should be a sharded DTensor")
    return checker


@case("api")
def case_scheduling_hints(ctx):
    """Prefetch lists are accepted and change no result."""

    def wrap(impl, model, mesh):
        M.shard_blocks(impl, model, mesh)
        blocks = list(model.blocks)
        for a, b in zip(blocks, blocks[1:]):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])

    def before_step(model):  # a CPU run has no device events; only the twinshard API takes None
        if not model.__class__.__module__.startswith("torch"):
            model.set_post_optim_event(None)

    return train_case(ctx, M.mlp_recipe(ctx.world, wrap=wrap, before_step=before_step))
