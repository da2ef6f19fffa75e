"""Judging a variant that changes the numbers on purpose (``twinshard.variants``).

A lossy variant fails every exact comparison whether it is right or wrong, so the suite holds
it to yardsticks built from what it declares (``Communication``: the parameter every rank
computes with, ``gathered``, and the sum of one shard group's gradients, ``gradient_sum``):

- **the exact oracle**: the plain model with the same transform applied at the same points
  (``run_plain_with``: every rank's slice of the batch through the gathered weights; each
  parameter's gradients summed as the variant sums them, replica by replica, then averaged).
  The run under test must come within twice the noise of its own exact run at this mesh
  (``lossy_noise.py``: measured against the plain model, never tuned); the oracles' runs
  (the reference, torch's) within fp32's tolerances. A wrong scale, a block cut elsewhere, a
  sum without its division all show, by thousands of times the bound.
- **the wire** (``lossy_wire.py``): what the run put on the wire is what the variant's
  declared format gives, computed from its bits, block and the parameters' segments, not from
  what the variant reports (an "int4" all-gather that sends a code a byte shows here even if
  its numbers were right), with no floating-point all-gather beside them but hpZ's within a
  node; qgZ and the bf16 wire leave no floating-point reduce-scatter.
- **the collectives' results** (``lossy_witness.py``): every gathered parameter is the
  declared transform of its shards, bit for bit, and every sharded gradient the declared sum
  of the ranks' gradients, on every rank, step and run, oracles or not.
- **the error budget**: against the exact plain model, the run may be off by at most twice
  what the oracle itself is off, plus one rounding step of the transform at the tensor's
  magnitude (the ``low_precision`` class of ``compare.py``, with the oracle as its
  low-precision run): derived from the transform, never tuned.
"""

from __future__ import annotations

import copy
import importlib
import os

import torch
import torch.nn as nn

from twinshard.dispatch.standin import paused

from . import driver
from . import lossy_witness as witness
from .compare import Checker
from .driver import Recipe, Trace, compare, make_optimizer, run_oracle, run_plain, run_sharded
from .lossy_noise import Measured, Noise
from .lossy_wire import check_wire
from .lossy_witness import Witness
from .shared_runs import fingerprint, shared_by_cases
from .trace import CollectiveTrace

VARIANT_ENV = "TWINSHARD_CONFORM_VARIANT"  # twinshard conform --variant, for the ranks
NEEDS = ("attach", "gathered", "gradient_sum", "step", "name")


def load_variant(spec: str):
    """The variant ``twinshard conform --variant`` names: built-in variants as ``--variants``
    spells them (``qwz+qgz:node=2``), or ``MODULE:NAME``, an object of the module that gives
    what ``twinshard.variants.Communication`` gives (``NEEDS``). ValueError names what is
    wrong."""
    from twinshard.variants import KINDS, Communication, parse

    head = spec.partition(":")[0]
    if head.partition("+")[0] in KINDS:
        return Communication(parse(spec))
    module, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"--variant {spec!r}: use MODULE:NAME or built-ins such as qwz+qgz")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"--variant {spec!r}: {error}") from None
    missing = [n for n in NEEDS if not hasattr(found, n)]
    if missing:
        raise ValueError(f"--variant {spec!r} has no {', '.join(missing)} (see docs/variants.md)")
    return found


def given_variant():
    """The variant ``twinshard conform --variant`` passed to this rank, or None."""
    spec = os.environ.get(VARIANT_ENV)
    return load_variant(spec) if spec else None


def run_plain_with(recipe: Recipe, comm, shape: tuple[int, ...]) -> Trace:
    """The plain model trained as ``shape`` (``(S,)`` or ``(R, S)``) ranks would with
    ``comm``'s transform: the exact oracle of the variant. Like the plain model, it uses no
    streams, so it runs without the stand-in streams' checks."""
    with paused():
        return _plain_with(recipe, comm, shape)


def _plain_with(recipe: Recipe, comm, shape: tuple[int, ...]) -> Trace:
    replicas, ranks = (1, *shape)[-2:]
    world = replicas * ranks
    model = driver.seeded(recipe.build).to(driver.DEVICE)  # DEVICE: set per process
    opt = make_optimizer(recipe, model)
    trace = Trace(optimizer=opt)
    low = recipe.low_precision  # mixed precision: gathered, computed and cast in param_dtype
    for step in range(recipe.steps):
        batch = recipe.data(recipe.start + step)
        work = copy.deepcopy(model).to(low or torch.float32)
        if low is not None:  # the root's floating inputs cast, as cast_forward_inputs does
            work.register_forward_pre_hook(lambda m, args: driver.cast_floats(args, low))
        with torch.no_grad():
            for p, w in zip(model.parameters(), work.parameters()):
                w.copy_(comm.gathered(p.detach().to(w.dtype), ranks))
        losses, contributions = [], []  # contributions[rank][parameter], in the reduce dtype
        for rank in range(world):
            work.zero_grad(set_to_none=True)
            loss = recipe.loss(work, driver._slice(batch, rank, world))
            loss.backward()
            losses.append(loss.detach().float())
            reduce = recipe.low_reduce if low is not None else None
            contributions.append([_reduced(w.grad, reduce) for w in work.parameters()])
        for i, p in enumerate(model.parameters()):
            if contributions[0][i] is None:  # frozen: no gradient to reduce
                continue
            groups = [contributions[r * ranks : (r + 1) * ranks] for r in range(replicas)]
            sums = [comm.gradient_sum([c[i] for c in g], ranks) for g in groups]
            total = sum(sums[1:], sums[0]) / world
            p.grad = total.to(contributions[0][i].dtype).to(p.dtype)  # via the reduce dtype
        trace.losses.append(torch.stack(losses).mean())
        named = dict(model.named_parameters())
        trace.grads.append({n: driver._local(p.grad) for n, p in named.items()})
        opt.step()
        opt.zero_grad(set_to_none=True)
        trace.params.append({n: driver._local(p) for n, p in named.items()})
    trace.model = model
    return trace


def with_variant(recipe: Recipe, comm, wrap, witnesses: list | None = None) -> Recipe:
    """``recipe`` whose sharded runs put ``comm``'s variants on the model after ``wrap``, and
    (given a list) a ``lossy_witness.Witness`` appended to ``witnesses`` per run."""

    def wrapped(impl, model: nn.Module, mesh) -> None:
        wrap(impl, model, mesh)
        comm.attach(model, mesh)
        if witnesses is not None:
            witnesses.append(Witness(model))

    return Recipe(**{**recipe.__dict__, "wrap": wrapped})


def train_lossy(ctx, recipe: Recipe, comm, wrap) -> Checker:
    """The implementation under ``comm`` (put on after ``wrap`` shards the model) against its
    exact oracle (tight) and the exact plain model (within the budget), and its collectives'
    results against the declared transform (``lossy_witness.py``); so are torch's
    ``fully_shard`` and the reference, where they are not what is under test."""
    tight = _tight(recipe)
    budget = Checker("low_precision", low_eps=comm.step)
    measured = _measured(ctx, Recipe(**{**recipe.__dict__, "wrap": wrap}))
    witnesses: list = []
    recipe = with_variant(recipe, comm, wrap, witnesses)
    truth, oracle = run_plain(recipe), run_plain_with(recipe, comm, ctx.mesh_shape)
    with CollectiveTrace() as seen:
        runs = {ctx.impl_name: run_sharded(recipe, ctx.impl, ctx.mesh)[0]}
    seen_by = {ctx.impl_name: witnesses[-1]}
    from twinshard.variants import Communication

    if isinstance(comm, Communication):  # twinshard.variants' own: their wire formats known
        check_wire(tight, comm, seen.calls, ctx.impl_name, ctx.shard_size)
    else:
        tight.notes.append("wire not checked: the variant declares no wire format")
    for name, impl in (("reference", ctx.reference), ("torch", ctx.oracle)):
        if impl is not None:
            runs[name] = run_oracle(recipe, impl, ctx.mesh)[0]
            seen_by[name] = witnesses[-1]
    for name, run in runs.items():  # the most direct evidence first: what was gathered
        witness.check(tight, seen_by[name], run, comm, ctx.mesh, name, recipe.low_reduce)
        seen_by[name].remove()
        near = measured if name == ctx.impl_name else tight  # the oracles' own: fp32's
        compare(near, f"{name} vs the variant's plain oracle", run, oracle, truth_low=oracle)
        compare(budget, f"{name} vs the exact plain model", run, truth, truth_low=oracle)
    tight.absorb(measured)
    tight.notes += [note] if (note := measured.margin_note()) else []
    tight.absorb(budget)
    tight.notes.append(f"variant: {comm.name}")
    return tight


def _measured(ctx, exact: Recipe) -> Measured:
    """The bound of the run under test against its oracle (``lossy_noise.py``): the noise of
    the same implementation's exact run at this mesh, against the plain model computing as it
    does (in its precision, on each rank's slice, with no variant)."""
    from twinshard.variants import Communication

    def exact_runs():
        with paused():
            same = _plain_with(exact, Communication([]), ctx.mesh_shape)
        return run_sharded(exact, ctx.impl, ctx.mesh)[0], same

    # the lossy cases of one recipe share it (the variant is not in it): trained once a mesh
    run, same = shared_by_cases(f"exact {fingerprint(exact)}", ctx.impl_name, exact_runs)
    noise = Noise()
    compare(noise, "exact", run, same)
    reduce = exact.low_reduce if exact.low_precision is not None else torch.float32
    replicas, ranks = (1, *ctx.mesh_shape)[-2:]
    eps = torch.finfo(reduce).eps
    return Measured("measured", noise=noise, additions=ranks + replicas, eps=eps)


def _tight(recipe: Recipe) -> Checker:
    """How close a run must come to its exact oracle: fp32's tolerance, or with a
    low-precision ``reduce_dtype``, one rounding step of it at each tensor's magnitude (the
    implementation's own division and its all-reduce across replicas round in that dtype,
    which the declared transform leaves to it)."""
    reduce = recipe.low_reduce if recipe.low_precision is not None else torch.float32
    if reduce == torch.float32:
        return Checker("fp32")
    return Checker("low_precision", low_eps=torch.finfo(reduce).eps)


def _reduced(grad: torch.Tensor | None, dtype) -> torch.Tensor | None:
    """A rank's gradient as FSDP hands it to the reduction: in the reduce dtype (None: its own)."""
    return None if grad is None else grad.to(dtype or grad.dtype)
