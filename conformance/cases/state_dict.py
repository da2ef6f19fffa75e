"""State-dict and checkpoint cases: sharded and full state dicts, DCP across world sizes and
across implementations (the implementation under test, the reference and torch each save and
each load), and meta-device initialization.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from twinshard.dispatch.standin import paused

from .. import models as M
from ..compare import Checker, local_rows
from ..driver import compare, make_optimizer, run_plain, run_sharded
from .core import Context, case


def dsd():
    from torch.distributed.checkpoint import state_dict as dsd

    return dsd


def _close_to_full(checker: Checker, label: str, model: nn.Module, full: dict) -> None:
    """Every parameter block of ``model`` equals the same rows of ``full`` (plain tensors)."""
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
        checker.fail(
            f"state_dict keys differ from the plain model's: {sorted(set(sd) ^ set(plain.state_dict()))}"
        )
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
    sd = dsd()
    checker = Checker("fp32")
    recipe = M.mlp_recipe(ctx.world, steps=2)
    truth = run_plain(recipe)
    trace, model = run_sharded(recipe, ctx.impl, ctx.mesh)
    full_opts = sd.StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = sd.get_model_state_dict(model, options=full_opts)
    osd = sd.get_optimizer_state_dict(model, trace.optimizer, options=full_opts)
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
    load_opts = sd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    sd.set_model_state_dict(fresh, full if ctx.rank == 0 else {}, options=load_opts)
    _close_to_full(checker, "loaded", fresh, dict(truth.model.named_parameters()))
    fresh_opt = make_optimizer(recipe, fresh)
    sd.set_optimizer_state_dict(fresh, fresh_opt, osd if ctx.rank == 0 else {}, options=load_opts)
    more = replace(recipe, steps=1, start=2)
    a, _ = run_sharded(more, ctx.impl, ctx.mesh, model=model, opt=trace.optimizer)
    b, _ = run_sharded(more, ctx.impl, ctx.mesh, model=fresh, opt=fresh_opt)
    for name, value in a.params[0].items():
        checker.close(f"continued after load '{name}'", b.params[0][name], value)
    return checker


def _ckpt_dir(ctx: Context, source: str) -> str:
    return os.path.join(ctx.tmpdir, f"dcp-{source}")


def _dcp_state(model, opt):
    msd, osd = dsd().get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


@case(
    "checkpoint",
    needs=lambda ctx: ctx.world == 2 and not ctx.hsdp,
    why="checkpoints are saved at world size 2 (1D) and loaded at every other size",
)
def case_dcp_save(ctx):
    """Train 2 steps and save model + optimizer with DCP (for dcp_load at other sizes)."""
    import torch.distributed.checkpoint as dcp

    checker = Checker("fp32")
    recipe = M.mlp_recipe(ctx.world, steps=2)
    truth = run_plain(recipe)
    for source, impl, checks in sources(ctx):
        with checks:
            trace, model = run_sharded(recipe, impl, ctx.mesh)
            dcp.save(_dcp_state(model, trace.optimizer), checkpoint_id=_ckpt_dir(ctx, source))
        _close_to_full(
            checker, f"{source} before save", model, dict(truth.model.named_parameters())
        )
    return checker


def sources(ctx: Context):
    """The implementation under test and the oracles, each with the context to run it in
    (the oracles use no streams, so they run without stream checks)."""
    yield ctx.impl_name, ctx.impl, contextlib.nullcontext()
    if ctx.reference is not None:
        yield "reference", ctx.reference, paused()
    if ctx.oracle is not None:
        yield "torch", ctx.oracle, paused()


def _saved_in_this_run(ctx: Context) -> bool:
    """Whether dcp_save (world size 2) ran earlier in this run: it leaves a dcp-* folder."""
    return any(name.startswith("dcp-") for name in os.listdir(ctx.tmpdir))


@case(
    "checkpoint",
    needs=lambda ctx: not ctx.hsdp and _saved_in_this_run(ctx),
    why="the checkpoint matrix runs on 1D meshes and loads what dcp_save wrote at world size 2 "
    "in the same run (give --world-sizes with 2 before this size)",
)
def case_dcp_load(ctx):
    """Load the world-size-2 checkpoints (this implementation's and torch's) here, into this
    implementation and into torch's, and continue: identical to uninterrupted training."""
    checker = Checker("fp32")
    recipe = M.mlp_recipe(ctx.world, steps=4)
    truth = run_plain(recipe)
    for source, _, _ in sources(ctx):
        path = _ckpt_dir(ctx, source)
        if not os.path.isdir(path):
            checker.fail(f"no checkpoint at {path}: run the dcp_save case at world size 2 first")
            continue
        for target, impl, checks in sources(ctx):
            with checks:
                run, model = _load_and_continue(recipe, impl, ctx, path)
            label = f"saved by {source} at 2, loaded by {target} at {ctx.world}"
            for j in range(2):
                checker.close(f"{label} step {2 + j} loss", run.losses[j], truth.losses[2 + j])
            _close_to_full(checker, f"{label} final", model, dict(truth.model.named_parameters()))
    return checker


def _load_and_continue(recipe, impl, ctx: Context, path: str):
    """Build ``impl``'s sharded model with another init, load the checkpoint at ``path`` into
    it and its optimizer, and train steps 2 and 3."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(7)
    model = recipe.build()
    recipe.wrap(impl, model, ctx.mesh)
    opt = make_optimizer(recipe, model)
    state = _dcp_state(model, opt)
    dcp.load(state, checkpoint_id=path)
    dsd().set_state_dict(
        model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    run, _ = run_sharded(replace(recipe, steps=2, start=2), impl, ctx.mesh, model=model, opt=opt)
    return run, model


@case("state_dict")
def case_meta_init(ctx):
    """Build on the meta device, shard, to_empty, load the full state dict from rank 0, train."""
    sd = dsd()
    recipe = M.mlp_recipe(ctx.world)
    truth = run_plain(recipe)
    initial = run_plain(replace(recipe, steps=0)).model.state_dict()
    opts = sd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    checker = Checker("fp32")
    for label, impl, checks in sources(ctx):
        with checks:
            with torch.device("meta"):
                model = recipe.build()
            recipe.wrap(impl, model, ctx.mesh)
            model.to_empty(device=ctx.device)
            # set_model_state_dict writes into the dict it is given: hand it a copy each time
            sd.set_model_state_dict(model, dict(initial) if ctx.rank == 0 else {}, options=opts)
            run, _ = run_sharded(recipe, impl, ctx.mesh, model=model)
        compare(checker, f"{label} meta init", run, truth)
    return checker
