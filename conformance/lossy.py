"""Judging a variant that changes the numbers on purpose (``twinshard.variants``).

A lossy variant fails every exact comparison whether it is right or wrong, so the suite holds
it to two yardsticks built from what it declares (``Communication``: the parameter every rank
computes with, ``gathered``, and the sum of one shard group's gradients, ``gradient_sum``):

- **the exact oracle**: the plain model with the same transform applied at the same points
  (``run_plain_with``: every rank's slice of the batch through the gathered weights; each
  parameter's gradients summed as the variant sums them, replica by replica, then averaged).
  The run must equal it to fp32's tolerances: a wrong scale, a block cut elsewhere, a sum
  without its division all show.
- **the wire**: what the run put on the wire is what the variant says it sends: qwZ's
  all-gathers are of packed bytes, as many as its wire format gives (an "int8" all-gather
  that sends bf16 shows here even if its numbers were right), with no floating-point
  all-gather beside them but hpZ's within a node; qgZ and the bf16 wire leave no
  floating-point reduce-scatter, and exchange packed bytes or bf16 by all-to-all.
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
from .compare import Checker
from .driver import Recipe, Trace, compare, make_optimizer, run_oracle, run_plain, run_sharded
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
    for step in range(recipe.steps):
        batch = recipe.data(recipe.start + step)
        work = copy.deepcopy(model)
        with torch.no_grad():
            for p, w in zip(model.parameters(), work.parameters()):
                w.copy_(comm.gathered(p.detach(), ranks))
        losses, contributions = [], []  # contributions[rank][parameter]
        for rank in range(world):
            work.zero_grad(set_to_none=True)
            loss = recipe.loss(work, driver._slice(batch, rank, world))
            loss.backward()
            losses.append(loss.detach().float())
            contributions.append([w.grad for w in work.parameters()])
        for i, p in enumerate(model.parameters()):
            groups = [contributions[r * ranks : (r + 1) * ranks] for r in range(replicas)]
            sums = [comm.gradient_sum([c[i] for c in g], ranks) for g in groups]
            p.grad = (sum(sums[1:], sums[0]) / world).to(p.dtype)
        trace.losses.append(torch.stack(losses).mean())
        named = dict(model.named_parameters())
        trace.grads.append({n: driver._local(p.grad) for n, p in named.items()})
        opt.step()
        opt.zero_grad(set_to_none=True)
        trace.params.append({n: driver._local(p) for n, p in named.items()})
    trace.model = model
    return trace


def with_variant(recipe: Recipe, comm, wrap) -> Recipe:
    """``recipe`` whose sharded runs put ``comm``'s variants on the model after ``wrap``."""

    def wrapped(impl, model: nn.Module, mesh) -> None:
        wrap(impl, model, mesh)
        comm.attach(model, mesh)

    return Recipe(**{**recipe.__dict__, "wrap": wrapped})


def train_lossy(ctx, recipe: Recipe, comm) -> Checker:
    """The implementation under ``comm`` against its exact oracle (tight) and the exact plain
    model (within the budget); so are torch's ``fully_shard`` and the reference, where they
    are not what is under test."""
    tight = Checker("fp32")
    budget = Checker("low_precision", low_eps=comm.step)
    truth, oracle = run_plain(recipe), run_plain_with(recipe, comm, ctx.mesh_shape)
    with CollectiveTrace() as seen:
        runs = {ctx.impl_name: run_sharded(recipe, ctx.impl, ctx.mesh)[0]}
    from twinshard.variants import Communication

    if isinstance(comm, Communication):  # twinshard.variants' own: their wire formats known
        check_wire(tight, comm, seen.calls, ctx.impl_name)
    else:
        tight.notes.append("wire not checked: the variant declares no wire format")
    for name, impl in (("reference", ctx.reference), ("torch", ctx.oracle)):
        if impl is not None:
            runs[name] = run_oracle(recipe, impl, ctx.mesh)[0]
    for name, run in runs.items():
        compare(tight, f"{name} vs the variant's plain oracle", run, oracle)
        compare(budget, f"{name} vs the exact plain model", run, truth, truth_low=oracle)
    tight.absorb(budget)
    tight.notes.append(f"variant: {comm.name}")
    return tight


def check_wire(checker: Checker, comm, calls: list, label: str) -> None:
    """What ``calls`` (one sharded run's collectives) sent, against what ``comm``'s variants
    declare (see the module docstring)."""
    checker.count += 1
    floats = lambda op: [c for c in calls if c.op == op and c.dtype.is_floating_point]  # noqa: E731
    if comm.weights is not None:
        packed = sum(c.numel for c in calls if c.op == "all_gather" and c.dtype == torch.uint8)
        declared = sum(h["all_gather"].gathered_bytes for h in comm.hooks.values())
        if packed != declared:
            checker.fail(f"{label}: {packed} bytes of packed all-gathers, {declared} declared")
        if floats("all_gather") and comm.reshard_after_forward in (None, True, False):
            dtypes = sorted({str(c.dtype) for c in floats("all_gather")})
            checker.fail(f"{label}: {len(floats('all_gather'))} all-gathers sent {dtypes}")
    if comm.grads is not None:
        if floats("reduce_scatter"):
            checker.fail(f"{label}: {len(floats('reduce_scatter'))} floating reduce-scatters")
        wire = torch.bfloat16 if comm.grads.kind == "bf16-wire" else torch.uint8
        if not any(c.op == "all_to_all" and c.dtype == wire for c in calls):
            checker.fail(f"{label}: no all-to-all in {wire}: the gradients were not exchanged")
