"""Training cases: whole models trained a few steps, compared every step with the truth.

Each one trains the same recipe three ways (the plain model on the global batch, the
implementation under test, and the oracles) and compares the loss and every parameter and
gradient shard, step by step: model structures (one group, per block, Llama, tied weights,
a block used twice, dict outputs, frozen, unused and ignored parameters) and the reshard modes.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .. import models as M
from ..driver import run_sharded
from .core import case, train_case


@case("training")
def case_one_group(ctx):
    """The whole MLP as one group (root only)."""
    return train_case(
        ctx, M.mlp_recipe(ctx.world, wrap=lambda i, m, mesh: i.fully_shard(m, mesh=mesh))
    )


@case("training")
def case_per_block(ctx):
    """One group per block plus the root; uneven sizes (15, 37)."""
    return train_case(ctx, M.mlp_recipe(ctx.world))


@case("training")
def case_llama(ctx):
    """Llama-style transformer (grouped-query attention, SwiGLU 37), per block plus root."""
    return train_case(ctx, M.llama_recipe(ctx.world))


@case("training")
def case_llama_tied(ctx):
    """Tied input/output embedding in the root group."""
    return train_case(ctx, M.llama_recipe(ctx.world, tie=True))


@case("training")
def case_reshard_false(ctx):
    """reshard_after_forward=False: parameters stay unsharded until after backward."""
    wrap = functools.partial(M.shard_blocks, reshard_after_forward=False)
    return train_case(ctx, M.mlp_recipe(ctx.world, wrap=wrap))


@case("training")
def case_reshard_true_root(ctx):
    """reshard_after_forward=True given explicitly, so the root reshards too."""
    wrap = functools.partial(M.shard_blocks, reshard_after_forward=True)
    return train_case(ctx, M.mlp_recipe(ctx.world, wrap=wrap))


@case(
    "training",
    needs=lambda ctx: ctx.shard_size % 2 == 0,
    why="reshard_after_forward=2 needs an even shard group",
)
def case_reshard_int(ctx):
    """reshard_after_forward=2: a half-size piece is kept between forward and backward."""
    wrap = functools.partial(M.shard_blocks, reshard_after_forward=2)
    return train_case(ctx, M.mlp_recipe(ctx.world, wrap=wrap))


@case("training")
def case_module_twice(ctx):
    """A block used twice in one forward."""
    return train_case(ctx, replace(M.mlp_recipe(ctx.world), build=lambda: M.TwiceMLP()))


@case("training")
def case_two_forwards(ctx):
    """Two forwards, then one backward through both losses."""

    def loss(model, batch):
        x, y = batch
        n, half = x.shape[0], x.shape[0] // 2
        first = M.mse(model, (x[:half], y[:half])) if half else 0.0
        return (half * first + (n - half) * M.mse(model, (x[half:], y[half:]))) / n

    return train_case(ctx, replace(M.mlp_recipe(ctx.world), loss=loss))


@case("training")
def case_dict_output(ctx):
    """Blocks take and return dicts; the root returns a dataclass."""

    def loss(model, batch):
        x, y = batch
        return (model(x).prediction - y).pow(2).mean()

    return train_case(ctx, replace(M.mlp_recipe(ctx.world), build=lambda: M.DictMLP(), loss=loss))


@case("training")
def case_frozen(ctx):
    """Some parameters frozen (requires_grad=False) before sharding."""

    def build():
        model = M.MLPStack()
        model.blocks[0].w1.weight.requires_grad_(False)
        model.norm.requires_grad_(False)
        return model

    return train_case(ctx, replace(M.mlp_recipe(ctx.world), build=build))


@case("training")
def case_unused(ctx):
    """Parameters that forward never uses: no gradient, still resharded."""
    return train_case(ctx, replace(M.mlp_recipe(ctx.world), build=lambda: M.UnusedMLP()))


@case("training")
def case_changing_forward(ctx):
    """Every second step skips the last block: prefetch planned from the previous forward
    must not leave a gather behind or use it stale."""
    recipe = replace(M.mlp_recipe(ctx.world, steps=4), build=lambda: M.SometimesMLP())
    return train_case(ctx, recipe)


@case("training")
def case_ignored_params(ctx):
    """ignored_params stay plain tensors that FSDP neither shards nor reduces; averaging their
    gradients by hand restores data-parallel training."""

    def wrap(impl, model, mesh):
        model.to(mesh.device_type)  # FSDP moves what it shards; an ignored one is the user's
        M.shard_blocks(impl, model, mesh, ignored_params={model.head.bias})

    def average_ignored(model):
        dist.all_reduce(model.head.bias.grad)
        model.head.bias.grad /= ctx.world

    checker = train_case(ctx, M.mlp_recipe(ctx.world, wrap=wrap, before_step=average_ignored))
    _, model = run_sharded(M.mlp_recipe(ctx.world, wrap=wrap, steps=1), ctx.impl, ctx.mesh)
    checker.count += 1
    if isinstance(model.head.bias, DTensor) or not isinstance(model.head.weight, DTensor):
        checker.fail("head.bias was ignored and must stay a plain tensor (head.weight sharded)")
    return checker


def _shard_dim_1(ctx, recipe, no_oracle=None):
    from torch.distributed.tensor import Shard

    def wrap(impl, model, mesh):
        by_dim = lambda p: Shard(1) if p.dim() == 2 else None  # noqa: E731
        for block in model.blocks:
            impl.fully_shard(block, mesh=mesh, shard_placement_fn=by_dim)
        impl.fully_shard(model, mesh=mesh)

    recipe = replace(recipe, wrap=wrap)
    checker = train_case(ctx, recipe, no_oracle=no_oracle)
    _, model = run_sharded(replace(recipe, steps=1), ctx.impl, ctx.mesh)
    checker.count += 1
    if model.blocks[0].w1.weight.placements[-1] != Shard(1):
        checker.fail(f"w1.weight placements {model.blocks[0].w1.weight.placements}, asked Shard(1)")
    return checker


@case("training")
def case_shard_dim_1(ctx):
    """shard_placement_fn: the blocks' 2-D weights cut along dim 1 (Shard(1)), the rest along
    dim 0; widths (12, 24) that every world size 1-4 divides."""
    build = lambda: M.MLPStack(dim=12, hidden=24, n_blocks=3)  # noqa: E731
    data = M.batches(lambda g: (torch.randn(12, 12, generator=g), torch.randn(12, 12, generator=g)))
    return _shard_dim_1(ctx, M.mlp_recipe(ctx.world, build=build, data=data))


@case("training")
def case_shard_dim_1_uneven(ctx):
    """Shard(1) on uneven widths (37 and 15 columns): the last ranks hold fewer columns."""
    reason = "torch's fully_shard refuses uneven sharding on a dim other than 0"
    return _shard_dim_1(ctx, M.mlp_recipe(ctx.world), no_oracle=reason)
