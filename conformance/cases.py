"""The conformance cases. Each one trains or inspects a model through the interface only.

A case takes a ``Context`` (the implementation under test, the mesh, this rank) and returns a
``Checker`` with every comparison it made. Training cases compare the implementation with the
plain model (the truth) and with torch's ``fully_shard`` (the oracle), step by step.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from .compare import Checker
from .driver import Recipe, compare, run_plain, run_sharded
from . import models as M


@dataclass
class Context:
    impl: object  # the implementation module under test
    impl_name: str
    oracle: object | None  # torch.distributed.fsdp, unless that is what is under test
    mesh_shape: tuple[int, ...]
    tmpdir: str
    reference: object | None = None  # twinshard.reference, unless that is what is under test
    _mesh: object = None

    @property
    def world(self) -> int:
        return int(torch.tensor(self.mesh_shape).prod())

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def hsdp(self) -> bool:
        return len(self.mesh_shape) == 2

    @property
    def shard_size(self) -> int:
        return self.mesh_shape[-1]

    @property
    def device_type(self) -> str:
        return "cuda" if dist.get_backend() == "nccl" else "cpu"

    @property
    def device(self) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def mesh(self):
        if self._mesh is None:
            kind = self.device_type
            names = ("replicate", "shard")[-len(self.mesh_shape):]  # torch wants HSDP names
            self._mesh = init_device_mesh(kind, self.mesh_shape, mesh_dim_names=names)
        return self._mesh


@dataclass
class Case:
    name: str
    fn: Callable[[Context], Checker]
    group: str
    needs: Callable[[Context], bool] = lambda ctx: True  # where the case applies
    doc: str = ""


CASES: dict[str, Case] = {}


def case(group: str, needs=None):
    def register(fn):
        name = fn.__name__.removeprefix("case_")
        CASES[name] = Case(name, fn, group, needs or (lambda ctx: True), (fn.__doc__ or "").strip())
        return fn
    return register


def train_case(ctx: Context, recipe: Recipe, tolerance: str = "fp32",
               no_oracle: str | None = None) -> Checker:
    """Truth, implementation and oracle on the same recipe, compared every step.

    ``no_oracle`` says why torch's ``fully_shard`` cannot run this case here (then it is
    compared with the truth only, and the reason goes into the report).
    """
    checker = Checker(tolerance)
    if recipe.low_precision is not None:
        checker.low_eps = torch.finfo(recipe.low_precision).eps
    if no_oracle and ctx.oracle is not None:
        checker.notes.append(f"torch oracle skipped: {no_oracle}")
        ctx = replace(ctx, oracle=None)
    truth = run_plain(recipe)
    truth_low = (run_plain(recipe, low=recipe.low_precision, world=ctx.world)
                 if recipe.low_precision else None)
    mine, _ = run_sharded(recipe, ctx.impl, ctx.mesh)
    compare(checker, ctx.impl_name, mine, truth, truth_low)
    if ctx.reference is not None:
        # The same reduction order gives the same bits: fp32 at world size <= 2.
        exact = recipe.low_precision is None and ctx.world <= 2
        against = Checker("bitwise" if exact else tolerance, low_eps=checker.low_eps)
        theirs, _ = run_sharded(recipe, ctx.reference, ctx.mesh)
        compare(against, f"{ctx.impl_name} vs reference", mine, truth, truth_low, other=theirs)
        checker.absorb(against)
    if ctx.oracle is not None:
        theirs, _ = run_sharded(recipe, ctx.oracle, ctx.mesh)
        compare(checker, "torch", theirs, truth, truth_low)
        compare(checker, f"{ctx.impl_name} vs torch", mine, truth, truth_low, other=theirs)
    return checker


# --- training --------------------------------------------------------------------------------
@case("training")
def case_one_group(ctx):
    """The whole MLP as one group (root only)."""
    return train_case(ctx, M.mlp_recipe(ctx.world, wrap=lambda i, m, mesh: i.fully_shard(m, mesh=mesh)))


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


@case("training", needs=lambda ctx: ctx.shard_size % 2 == 0)
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


# --- gradient accumulation and clipping ------------------------------------------------------------
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


@case("gradients", needs=lambda ctx: ctx.hsdp)
def case_no_all_reduce(ctx):
    """HSDP: set_requires_all_reduce(False) on the first micro-batch."""
    def on_micro(model, micro, last):
        model.set_requires_all_reduce(last)
    return train_case(ctx, M.mlp_recipe(ctx.world, micro=2, on_micro=on_micro))


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
    gloo = dist.get_backend() == "gloo"
    reason = "torch reduces with ReduceOp.PREMUL_SUM, which gloo lacks" if gloo else None
    return train_case(ctx, M.mlp_recipe(ctx.world, wrap=wrap, loss=loss), no_oracle=reason)


# --- mixed precision ------------------------------------------------------------------------------
def _mp_recipe(ctx, param=torch.bfloat16, reduce=torch.float32, output=None, cast_children=True):
    def wrap(impl, model, mesh):
        child = impl.MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce,
                                          cast_forward_inputs=cast_children)
        for block in model.blocks:
            impl.fully_shard(block, mesh=mesh, mp_policy=child)
        root = impl.MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce, output_dtype=output)
        impl.fully_shard(model, mesh=mesh, mp_policy=root)
    return M.mlp_recipe(ctx.world, wrap=wrap, low_precision=param, low_reduce=reduce)


def _compute_dtypes(ctx, recipe) -> dict[str, torch.dtype]:
    """The dtype of each block's weight as its forward sees it (the unsharded parameter)."""
    model = recipe.build()
    recipe.wrap(ctx.impl, model, ctx.mesh)
    seen = {}
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(  # runs after FSDP's own pre-forward (prepended)
            lambda m, args, i=i: seen.__setitem__(f"blocks.{i}.w1.weight", m.w1.weight.dtype))
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


# --- offload and the explicit API ------------------------------------------------------------------
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


@case("training")
def case_ignored_params(ctx):
    """ignored_params stay plain tensors that FSDP neither shards nor reduces; averaging their
    gradients by hand restores data-parallel training."""
    def wrap(impl, model, mesh):
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


@case("api")
def case_reshard_states(ctx):
    """After forward: blocks resharded, the root kept unsharded; after backward: all sharded.
    With reshard_after_forward=False the blocks stay unsharded until after backward."""
    checker = Checker("fp32")
    for label, kwargs in (("default", {}), ("reshard_after_forward=False",
                                           {"reshard_after_forward": False})):
        model = M.MLPStack()
        M.shard_blocks(ctx.impl, model, ctx.mesh, **kwargs)
        loss = model(torch.randn(4, 15)).pow(2).mean()
        block_sharded = isinstance(model.blocks[0].w1.weight, DTensor)
        expected = not kwargs
        checker.count += 3
        if block_sharded != expected:
            checker.fail(f"{label}: after forward a block is {'sharded' if block_sharded else 'unsharded'}")
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


# --- state dicts and checkpoints ----------------------------------------------------------------------
def _dsd():
    from torch.distributed.checkpoint import state_dict as dsd
    return dsd


def _close_to_full(checker: Checker, label: str, model: nn.Module, full: dict) -> None:
    """Every parameter block of ``model`` equals the same rows of ``full`` (plain tensors)."""
    from .compare import local_rows
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            checker.close(f"{label} '{name}'", p.to_local(), local_rows(full[name], p))
        else:
            checker.close(f"{label} '{name}'", p, full[name])


@case("state_dict")
def case_sharded_state_dict(ctx):
    """state_dict() holds DTensor blocks under the plain keys; load_state_dict restores them."""
    checker = Checker("fp32")
    recipe = M.mlp_recipe(ctx.world, steps=1)
    plain = run_plain(recipe).model
    _, model = run_sharded(recipe, ctx.impl, ctx.mesh)
    sd = model.state_dict()
    if set(sd) != set(plain.state_dict()):
        checker.fail(f"state_dict keys differ from the plain model's: {sorted(set(sd) ^ set(plain.state_dict()))}")
    for name, value in sd.items():
        if not isinstance(value, DTensor):
            checker.fail(f"state_dict['{name}'] is a {type(value).__name__}, expected a DTensor")
    _close_to_full(checker, "state_dict", model, dict(plain.named_parameters()))
    saved = {k: v.detach().clone() for k, v in sd.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    model.load_state_dict(saved)
    exact = Checker("bitwise")
    for name, value in model.state_dict().items():
        exact.close(f"after load_state_dict '{name}'", value.to_local(), saved[name].to_local())
    checker.failures += exact.failures
    return checker


@case("state_dict")
def case_full_state_dict(ctx):
    """get/set_model_state_dict with full_state_dict, cpu_offload and broadcast_from_rank0;
    the optimizer state round-trips and training continues identically."""
    dsd = _dsd()
    checker = Checker("fp32")
    recipe = M.mlp_recipe(ctx.world, steps=2)
    truth = run_plain(recipe)
    trace, model = run_sharded(recipe, ctx.impl, ctx.mesh)
    full_opts = dsd.StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = dsd.get_model_state_dict(model, options=full_opts)
    osd = dsd.get_optimizer_state_dict(model, trace.optimizer, options=full_opts)
    if ctx.rank == 0:
        plain_sd = truth.model.state_dict()
        for name in plain_sd:
            checker.close(f"full state dict '{name}'", full.get(name), plain_sd[name])
            if name in full and full[name].device.type != "cpu":
                checker.fail(f"full state dict '{name}' not on the CPU with cpu_offload=True")
    elif full:
        checker.fail(f"rank {ctx.rank}: cpu_offload full state dict should be empty off rank 0")
    torch.manual_seed(7)  # a different init, overwritten by the load
    fresh = recipe.build()
    recipe.wrap(ctx.impl, fresh, ctx.mesh)
    load_opts = dsd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    dsd.set_model_state_dict(fresh, full if ctx.rank == 0 else {}, options=load_opts)
    _close_to_full(checker, "loaded", fresh, dict(truth.model.named_parameters()))
    from .driver import make_optimizer
    fresh_opt = make_optimizer(recipe, fresh)
    dsd.set_optimizer_state_dict(fresh, fresh_opt, osd if ctx.rank == 0 else {}, options=load_opts)
    more = replace(recipe, steps=1, start=2)
    a, _ = run_sharded(more, ctx.impl, ctx.mesh, model=model, opt=trace.optimizer)
    b, _ = run_sharded(more, ctx.impl, ctx.mesh, model=fresh, opt=fresh_opt)
    for name, value in a.params[0].items():
        checker.close(f"continued after load '{name}'", b.params[0][name], value)
    return checker


def _ckpt_dir(ctx: Context, source: str) -> str:
    return os.path.join(ctx.tmpdir, f"dcp-{source}")


def _dcp_state(model, opt):
    msd, osd = _dsd().get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


@case("checkpoint", needs=lambda ctx: ctx.world == 2 and not ctx.hsdp)
def case_dcp_save(ctx):
    """Train 2 steps and save model + optimizer with DCP (for dcp_load at other sizes)."""
    import torch.distributed.checkpoint as dcp
    checker = Checker("fp32")
    recipe = M.mlp_recipe(ctx.world, steps=2)
    truth = run_plain(recipe)
    for source, impl in _sources(ctx):
        trace, model = run_sharded(recipe, impl, ctx.mesh)
        _close_to_full(checker, f"{source} before save", model, dict(truth.model.named_parameters()))
        dcp.save(_dcp_state(model, trace.optimizer), checkpoint_id=_ckpt_dir(ctx, source))
    return checker


def _sources(ctx: Context):
    """The implementation under test and the oracles: the checkpoint matrix runs over these."""
    yield ctx.impl_name, ctx.impl
    if ctx.reference is not None:
        yield "reference", ctx.reference
    if ctx.oracle is not None:
        yield "torch", ctx.oracle


@case("checkpoint", needs=lambda ctx: not ctx.hsdp)
def case_dcp_load(ctx):
    """Load the world-size-2 checkpoints (this implementation's and torch's) here, into this
    implementation and into torch's, and continue: identical to uninterrupted training."""
    import torch.distributed.checkpoint as dcp
    checker = Checker("fp32")
    recipe = M.mlp_recipe(ctx.world, steps=4)
    truth = run_plain(recipe)
    for source, _ in _sources(ctx):
        path = _ckpt_dir(ctx, source)
        if not os.path.isdir(path):
            checker.fail(f"no checkpoint at {path}: run the dcp_save case at world size 2 first")
            continue
        for target, impl in _sources(ctx):
            torch.manual_seed(7)
            model = recipe.build()
            recipe.wrap(impl, model, ctx.mesh)
            from .driver import make_optimizer
            opt = make_optimizer(recipe, model)
            state = _dcp_state(model, opt)
            dcp.load(state, checkpoint_id=path)
            _dsd().set_state_dict(model, opt, model_state_dict=state["model"],
                                  optim_state_dict=state["optim"])
            more = replace(recipe, steps=2, start=2)
            run, _ = run_sharded(more, impl, ctx.mesh, model=model, opt=opt)
            label = f"saved by {source} at 2, loaded by {target} at {ctx.world}"
            for j in range(2):
                checker.close(f"{label} step {2 + j} loss", run.losses[j], truth.losses[2 + j])
            _close_to_full(checker, f"{label} final", model, dict(truth.model.named_parameters()))
    return checker


@case("state_dict")
def case_meta_init(ctx):
    """Build on the meta device, shard, to_empty, load the full state dict from rank 0, train."""
    dsd = _dsd()
    recipe = M.mlp_recipe(ctx.world)
    truth = run_plain(recipe)
    initial = run_plain(replace(recipe, steps=0)).model.state_dict()
    opts = dsd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    checker = Checker("fp32")
    for label, impl in _sources(ctx):
        with torch.device("meta"):
            model = recipe.build()
        recipe.wrap(impl, model, ctx.mesh)
        model.to_empty(device=ctx.device)
        # set_model_state_dict writes into the dict it is given: hand it a copy each time
        dsd.set_model_state_dict(model, dict(initial) if ctx.rank == 0 else {}, options=opts)
        run, _ = run_sharded(recipe, impl, ctx.mesh, model=model)
        compare(checker, f"{label} meta init", run, truth)
    return checker


# --- misuse ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _expect_error(checker: Checker, what: str, *words: str):
    checker.count += 1
    try:
        yield
    except (ValueError, RuntimeError, TypeError, AssertionError) as error:
        text = str(error).lower()
        # a word given as a tuple is satisfied by any one of its alternatives
        missing = [w for w in words
                   if not any(a.lower() in text for a in (w if isinstance(w, tuple) else (w,)))]
        if missing:
            checker.fail(f"{what}: the error does not mention {missing}: {text!r}")
    else:
        checker.fail(f"{what}: no error was raised")


@case("errors")
def case_errors(ctx):
    """Misuse gives a clear error that names the module or parameter."""
    checker = Checker("fp32")
    impl, mesh = ctx.impl, ctx.mesh
    with _expect_error(checker, "ModuleList", "ModuleList"):
        impl.fully_shard(nn.ModuleList([nn.Linear(3, 3)]), mesh=mesh)
    with _expect_error(checker, "3D mesh", "mesh"):
        impl.fully_shard(nn.Linear(3, 3), mesh=init_device_mesh(ctx.device_type, (1, 1, ctx.world)))
    with _expect_error(checker, "reshard_after_forward='yes'", "reshard_after_forward"):
        impl.fully_shard(nn.Linear(3, 3), mesh=mesh, reshard_after_forward="yes")
    with _expect_error(checker, "reshard_after_forward=0", "reshard_after_forward"):
        impl.fully_shard(nn.Linear(3, 3), mesh=mesh, reshard_after_forward=0)
    twice = nn.Linear(3, 3)
    impl.fully_shard(twice, mesh=mesh)
    with _expect_error(checker, "applied twice"):
        impl.fully_shard(twice, mesh=mesh)
    with _expect_error(checker, "deepcopy", "deepcopy"):
        copy.deepcopy(twice)
    with torch.device("meta"):
        on_meta = M.MLPStack()
    M.shard_blocks(impl, on_meta, mesh)
    with _expect_error(checker, "parameters left on meta", "meta"):
        on_meta(torch.randn(2, 15))
    tied = M.Llama(M.llama_config(tie=True))
    impl.fully_shard(tied.tok_embeddings, mesh=mesh)
    with _expect_error(checker, "tied parameters split across groups",
                       ("output.weight", "tok_embeddings.weight")):
        impl.fully_shard(tied, mesh=mesh)
        tied(torch.zeros(1, 4, dtype=torch.long))
    return checker


@case("errors")
def case_child_forward_first(ctx):
    """Forward through a block before the root: an error that says to run the root first."""
    checker = Checker("fp32")
    for label, impl in _sources(ctx):
        model = M.MLPStack()
        M.shard_blocks(impl, model, ctx.mesh)
        model.blocks[0](torch.randn(2, 15))
        with _expect_error(checker, f"{label}: child before root", "root"):
            model(torch.randn(2, 15))
    return checker


# --- the collective trace ----------------------------------------------------------------------------
def _trace_case(ctx, unshards_block: int, unshards_root: int, param=torch.float32,
                reduce=torch.float32, **kwargs) -> Checker:
    """Trace one forward+backward of the per-block MLP and check it against the schedule."""
    from . import trace as T
    checker = Checker("fp32")
    plain = M.MLPStack()
    groups = [(list(b.parameters()), unshards_block) for b in plain.blocks]
    groups.append((list(plain.norm.parameters()) + list(plain.head.parameters()), unshards_root))
    model = M.MLPStack()
    if param != torch.float32 or reduce != torch.float32:
        kwargs["mp_policy"] = ctx.impl.MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)
    M.shard_blocks(ctx.impl, model, ctx.mesh, **kwargs)
    x, y = M.mlp_data()(0)
    per = x.shape[0] // ctx.world
    x, y = (t[ctx.rank * per:(ctx.rank + 1) * per].to(ctx.device) for t in (x, y))
    with T.CollectiveTrace() as recorded:
        M.mse(model, (x, y)).backward()
    calls = recorded.calls
    checker.count += 1
    if (mismatch := T.compare_ranks(calls)) is not None:
        checker.fail(f"collective traces differ across ranks: {mismatch}")
    S = ctx.shard_size
    size = lambda ps: sum(T.padded_numel(p, S) for p in ps)  # noqa: E731
    expect = {
        "all_gather": ([n for _, n in groups], sum(n * size(ps) for ps, n in groups), param,
                       [n * len(ps) for ps, n in groups]),
        "reduce_scatter": ([1 for _ in groups], sum(size(ps) for ps, _ in groups), reduce,
                           [len(ps) for ps, _ in groups]),
    }
    if ctx.hsdp:
        expect["all_reduce"] = ([1 for _ in groups], sum(size(ps) // S for ps, _ in groups),
                                reduce, [len(ps) for ps, _ in groups])
    for op, (per_group, numel, dtype, per_param) in expect.items():
        count, total, dtypes = T.totals(calls, op)
        checker.count += 1
        if S == 1 and op != "all_reduce" and count == 0:
            continue  # with one shard there is nothing to gather or scatter; skipping is valid
        if count not in (sum(per_group), sum(per_param)):
            checker.fail(f"{op}: {count} collectives, expected {sum(per_group)} (one per group "
                         f"and unshard) or {sum(per_param)} (one per parameter)")
        if total != numel:
            checker.fail(f"{op}: {total} elements in all, the schedule implies {numel}")
        if dtypes != {dtype}:
            checker.fail(f"{op}: dtypes {sorted(map(str, dtypes))}, the policy says {dtype}")
    return checker


@case("trace")
def case_trace_default(ctx):
    """Default schedule: blocks gathered in forward and backward, the root once; one
    reduce-scatter per group; the same sequence on every rank."""
    return _trace_case(ctx, 2, 1)


@case("trace")
def case_trace_reshard_false(ctx):
    """reshard_after_forward=False: every group is gathered once per step."""
    return _trace_case(ctx, 1, 1, reshard_after_forward=False)


@case("trace", needs=lambda ctx: ctx.shard_size % 2 == 0 and ctx.shard_size > 2)
def case_trace_reshard_int(ctx):
    """reshard_after_forward=2: backward gathers among 2 ranks, same amount of data."""
    return _trace_case(ctx, 2, 2, reshard_after_forward=2)


@case("trace")
def case_trace_bf16_fp32(ctx):
    """param_dtype bf16, reduce_dtype fp32: all-gathers in bf16, reductions in fp32."""
    return _trace_case(ctx, 2, 1, param=torch.bfloat16, reduce=torch.float32)


@case("trace")
def case_trace_bf16_bf16(ctx):
    """param_dtype bf16, reduce_dtype bf16: every collective in bf16."""
    return _trace_case(ctx, 2, 1, param=torch.bfloat16, reduce=torch.bfloat16)
