"""Cases of the communication hooks and of the remaining ``FSDPModule`` methods.

A researcher writes a variant by swapping a collective: ``set_custom_all_gather`` (here an
all-gather in bf16 of fp32 parameters), ``set_custom_reduce_scatter``, ``set_all_reduce_hook``.
The other cases call every method of torch's ``FSDPModule`` that tunes an implementation,
recover from an exception in the middle of a step with ``reset_iter_state``, skip the backward
all-gather of an embedding, gather a group of two dtypes, and check that one rank alone
issues no collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import models as M
from .. import trace as T
from ..compare import Checker
from .core import case, torch_cannot, train_case


class Bf16AllGather:
    """torch's ``AllGather`` interface: gathers fp32 parameters in bf16 (half the bytes)."""

    def __init__(self):
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        low = torch.empty(output_tensor.shape, dtype=torch.bfloat16, device=output_tensor.device)
        dist.all_gather_into_tensor(low, input_tensor.to(torch.bfloat16), group=group)
        output_tensor.copy_(low)  # the parameters come out rounded to bf16
        return None


class CountingReduceScatter:
    """torch's ``ReduceScatter`` interface: the default reduce-scatter, counted."""

    def __init__(self):
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        return reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


@case("comm_hooks")
def case_custom_all_gather_bf16(ctx):
    """set_custom_all_gather with an all-gather in bf16 of fp32 parameters: within the bf16
    tolerance of the plain model, and every gather went through the hook."""
    hooks = []

    def wrap(impl, model, mesh):
        M.shard_blocks(impl, model, mesh)
        for m in (*model.blocks, model):
            hooks.append(Bf16AllGather())
            m.set_custom_all_gather(hooks[-1])

    recipe = M.mlp_recipe(ctx.world, wrap=wrap, low_precision=torch.bfloat16)
    checker = train_case(ctx, recipe, "low_precision")
    checker.count += 1
    if ctx.shard_size > 1 and not any(h.calls for h in hooks):
        checker.fail("the custom all-gather was never called")
    return checker


@case("comm_hooks")
def case_custom_reduce_scatter(ctx):
    """set_custom_reduce_scatter: the gradients are exact and the hook did the reductions."""
    hooks = []

    def wrap(impl, model, mesh):
        M.shard_blocks(impl, model, mesh)
        for m in (*model.blocks, model):
            hooks.append(CountingReduceScatter())
            m.set_custom_reduce_scatter(hooks[-1])

    checker = train_case(ctx, M.mlp_recipe(ctx.world, wrap=wrap))
    checker.count += 1
    if ctx.shard_size > 1 and not any(h.calls for h in hooks):
        checker.fail("the custom reduce-scatter was never called")
    return checker


@case("comm_hooks")
def case_all_reduce_hook(ctx):
    """set_all_reduce_hook halves every reduced gradient in place; the plain model's loss
    gradient is halved to match."""

    def wrap(impl, model, mesh):
        M.shard_blocks(impl, model, mesh)
        for m in (*model.blocks, model):
            m.set_all_reduce_hook(lambda reduced: reduced.mul_(0.5))

    def loss(model, batch):
        value = M.mse(model, batch)
        if isinstance(model, M.MLPStack) and not hasattr(model, "set_all_reduce_hook"):
            return 0.5 * value + (value - 0.5 * value).detach()  # value: loss; gradient: half
        return value

    return train_case(ctx, M.mlp_recipe(ctx.world, wrap=wrap, loss=loss))


@case("comm_hooks")
def case_fsdp_module_methods(ctx):
    """Every tuning method of torch's FSDPModule is accepted with torch's arguments, and
    training is unchanged afterwards."""

    def wrap(impl, model, mesh):
        M.shard_blocks(impl, model, mesh)
        model.set_reduce_scatter_max_input_buffers(2)
        model.set_force_sum_reduction_for_comms(True)
        model.set_unshard_in_backward(True)
        if ctx.device_type != "cpu":  # an accelerator's backend
            model.set_separate_reduce_scatter_group(True)
            model.set_allocate_memory_from_process_group_for_comm(False)
        elif getattr(impl, "__name__", "").startswith("twinshard"):
            model.set_separate_reduce_scatter_group(True)  # a second gloo group for twinshard

    newer = ("set_reduce_scatter_max_input_buffers", "set_force_sum_reduction_for_comms")
    return train_case(ctx, M.mlp_recipe(ctx.world, wrap=wrap), no_oracle=torch_cannot(newer))


@case("comm_hooks")
def case_reset_after_error(ctx):
    """A forward that raises midway, then reset_iter_state() on the root: the next steps train
    as if the failed one had never happened."""

    def wrap(impl, model, mesh):
        M.shard_blocks(impl, model, mesh)

        def fail(module, args):
            raise RuntimeError("planted failure")

        handle = model.blocks[1].register_forward_pre_hook(fail)
        try:
            model(torch.randn(2, 15, device=ctx.device))
        except RuntimeError:
            model.reset_iter_state()
        handle.remove()
        model.reshard()  # torch's reset leaves the root unsharded; the optimizer needs DTensors

    missing = torch_cannot(("reset_iter_state",))
    return train_case(ctx, M.mlp_recipe(ctx.world, wrap=wrap), no_oracle=missing)


@case("comm_hooks")
def case_unshard_in_backward_false(ctx):
    """set_unshard_in_backward(False) on the token embedding (its backward needs no weights):
    training is unchanged, and the embedding is gathered only in forward."""

    def wrap(impl, model, mesh):
        impl.fully_shard(model.tok_embeddings, mesh=mesh)
        for block in model.blocks:
            impl.fully_shard(block, mesh=mesh)
        impl.fully_shard(model, mesh=mesh)
        model.tok_embeddings.set_unshard_in_backward(False)

    return train_case(ctx, M.llama_recipe(ctx.world, wrap=wrap))


@case("comm_hooks")
def case_mixed_dtypes_in_a_group(ctx):
    """A frozen float8 parameter beside float32 ones in each block's group."""
    return train_case(ctx, M.mlp_recipe(ctx.world, build=lambda: M.Float8ScaleMLP()))


@case("comm_hooks", needs=lambda ctx: ctx.world == 1, why="only one rank can skip every collective")
def case_one_rank_no_collectives(ctx):
    """On one rank there is nothing to exchange: a training step issues no collective."""
    checker = Checker("fp32")
    model = M.MLPStack()
    M.shard_blocks(ctx.impl, model, ctx.mesh)
    with T.CollectiveTrace() as recorded:
        M.mse(model, [t.to(ctx.device) for t in M.mlp_data()(0)]).backward()
    checker.count += 1
    if recorded.calls:
        ops = sorted({c.op for c in recorded.calls})
        checker.fail(f"{len(recorded.calls)} collectives on one rank ({', '.join(ops)})")
    return checker
