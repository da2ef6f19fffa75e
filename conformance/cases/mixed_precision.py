"""Mixed-precision cases: ``MixedPrecisionPolicy`` against the plain model in low precision.

The tolerance is derived, not tuned: within twice the error of the same data-parallel
computation done in low precision on the plain model (see ``compare.py``).
"""

from __future__ import annotations

import torch

from .. import models as M
from .core import case, train_case


def _mp_recipe(ctx, param=torch.bfloat16, reduce=torch.float32, output=None, cast_children=True):
    def wrap(impl, model, mesh):
        child = impl.MixedPrecisionPolicy(
            param_dtype=param, reduce_dtype=reduce, cast_forward_inputs=cast_children
        )
        for block in model.blocks:
            impl.fully_shard(block, mesh=mesh, mp_policy=child)
        root = impl.MixedPrecisionPolicy(
            param_dtype=param, reduce_dtype=reduce, output_dtype=output
        )
        impl.fully_shard(model, mesh=mesh, mp_policy=root)

    return M.mlp_recipe(ctx.world, wrap=wrap, low_precision=param, low_reduce=reduce)


def _compute_dtypes(ctx, recipe) -> dict[str, torch.dtype]:
    """The dtype of each block's weight as its forward sees it (the unsharded parameter)."""
    model = recipe.build()
    recipe.wrap(ctx.impl, model, ctx.mesh)
    seen = {}
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(  # runs after FSDP's own pre-forward (prepended)
            lambda m, args, i=i: seen.__setitem__(f"blocks.{i}.w1.weight", m.w1.weight.dtype)
        )
    model(torch.randn(2, 15))
    return seen


@case("mixed_precision")
def case_bf16_reduce_fp32(ctx):
    """param_dtype bf16, reduce_dtype fp32; forward computes with bf16 weights."""
    recipe = _mp_recipe(ctx)
    checker = train_case(ctx, recipe, "low_precision")
    for name, dtype in _compute_dtypes(ctx, recipe).items():
        checker.count += 1
        if dtype != torch.bfloat16:
            checker.fail(f"'{name}' is {dtype} inside forward; param_dtype asked for bfloat16")
    return checker


@case("mixed_precision")
def case_bf16_reduce_bf16(ctx):
    """param_dtype bf16, reduce_dtype bf16."""
    return train_case(ctx, _mp_recipe(ctx, reduce=torch.bfloat16), "low_precision")


@case("mixed_precision")
def case_bf16_output_fp32(ctx):
    """output_dtype fp32 on the root: the model's output comes back in fp32."""
    checker = train_case(ctx, _mp_recipe(ctx, output=torch.float32), "low_precision")
    model = M.MLPStack()
    _mp_recipe(ctx, output=torch.float32).wrap(ctx.impl, model, ctx.mesh)
    out = model(torch.randn(2, 15))
    if out.dtype != torch.float32:
        checker.fail(f"output dtype {out.dtype}, policy asked for float32")
    return checker


@case("mixed_precision")
def case_bf16_no_cast_children(ctx):
    """cast_forward_inputs=False on the blocks (their inputs are bf16 already)."""
    return train_case(ctx, _mp_recipe(ctx, cast_children=False), "low_precision")
