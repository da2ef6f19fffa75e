"""Train the same model three ways and record every step: the plain model, the implementation
under test, and torch's ``fully_shard`` (the oracles), so that a case can compare them.

All three start from the same unsharded initial state (the model is built under one seed).
The plain model trains on the whole global batch; each rank of a sharded run trains on its own
slice of it, so averaging gradients over ranks must reproduce the plain gradients. Optimizer:
SGD with momentum (Adam would hide a wrong gradient scale).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from twinshard.dispatch.standin import paused

from .compare import Checker, local_rows

DEVICE = torch.device("cpu")  # where models and batches live; the runner sets it per process


def set_device(device: torch.device) -> None:
    global DEVICE
    DEVICE = torch.device(device)


@dataclass
class Recipe:
    """What to train and how; the defaults are one plain training step per iteration."""

    build: Callable[[], nn.Module]  # the unsharded model
    wrap: Callable[[Any, nn.Module, Any], None]  # (impl, model, mesh): applies fully_shard
    data: Callable[[int], tuple]  # global batch of step i, batch dimension first
    loss: Callable[[nn.Module, tuple], torch.Tensor]  # (model, batch) -> scalar
    steps: int = 3
    micro: int = 1  # micro-batches per step (gradient accumulation)
    on_micro: Callable | None = None  # (model, micro index, is last) before each backward
    before_step: Callable | None = None  # (model) after backward, before clipping and step
    clip: float | None = None  # max norm for clip_grad_norm_
    norm_type: float = 2.0
    lr: float = 0.05
    zero_grad_set_to_none: Callable[[int], bool] = lambda step: step % 2 == 0
    low_precision: torch.dtype | None = None  # param_dtype of the policy, for the plain oracle
    low_reduce: torch.dtype = torch.float32  # reduce_dtype of the policy, for the plain oracle
    start: int = 0  # first step's index into ``data`` (a resumed run continues from there)
    # The low-precision oracle adds a step's micro-batches up per rank, unreduced, in
    # low_reduce, as FSDP does while gradient sync is off (else it reduces each micro-batch).
    low_accumulate: bool = False
    # (rank, world) to cut the global batch by, when not every rank is its own data-parallel
    # rank (tensor parallelism: the ranks of one TP group see the same data)
    data_rank: Callable[[], tuple[int, int]] | None = None


@dataclass
class Trace:
    """What a run produced: per step the loss, gradients (before the step) and parameters."""

    losses: list[torch.Tensor] = field(default_factory=list)
    norms: list[torch.Tensor] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor | None]] = field(default_factory=list)
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    placements: dict[str, DTensor] = field(default_factory=dict)
    optimizer: torch.optim.Optimizer | None = None
    model: nn.Module | None = None  # the plain run's final model
    # a plain run's tensors cut down to a rank's blocks (``_cut``), by the tensor and the
    # placements: several sharded runs are compared with the same plain run, by several cases
    pieces: dict = field(default_factory=dict, repr=False)


def seeded(build: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return build()


def _local(t):
    if t is None:
        return None
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _float(v) -> torch.Tensor:
    if isinstance(v, DTensor):
        v = v.full_tensor()
    return torch.as_tensor(v).detach().float().cpu()


def _slice(batch: tuple, rank: int, world: int) -> tuple:
    out = []
    for t in batch:
        n = t.shape[0] // world
        out.append(t[rank * n : (rank + 1) * n].to(DEVICE))
    return tuple(out)


def run_plain(
    recipe: Recipe,
    low: torch.dtype | None = None,
    world: int = 1,
    model: nn.Module | None = None,
    opt: torch.optim.Optimizer | None = None,
) -> Trace:
    """The truth: the unsharded model on the global batch (or continue training a given plain
    ``model`` with its optimizer).

    With ``low``, the same computation as a data-parallel mixed-precision run instead: each of
    ``world`` slices of the batch runs through a ``low`` copy of the model, and the gradients
    are averaged in the policy's reduce dtype, as the ranks would. It is the yardstick for
    the error that low precision alone causes.
    """
    with paused():  # the truth uses no streams: nothing to check, and checks cost time
        model = seeded(recipe.build).to(DEVICE) if model is None else model
        trace = _train(recipe, model, model, rank=0, world=1, low=low, opt=opt, low_world=world)
    trace.model = model
    return trace


def run_sharded(
    recipe: Recipe,
    impl,
    mesh,
    model: nn.Module | None = None,
    opt: torch.optim.Optimizer | None = None,
) -> tuple[Trace, nn.Module]:
    """The implementation ``impl`` on this rank's slice of each global batch (or continue
    training a given sharded ``model`` and its optimizer)."""
    if model is None:
        model = seeded(recipe.build)
        recipe.wrap(impl, model, mesh)
    rank, world = (
        recipe.data_rank() if recipe.data_rank else (dist.get_rank(), dist.get_world_size())
    )
    trace = _train(recipe, model, None, rank, world, None, opt)
    return trace, model


def run_oracle(recipe: Recipe, impl, mesh) -> tuple[Trace, nn.Module]:
    """``run_sharded`` for an oracle (the reference, torch): without stream checks."""
    with paused():
        return run_sharded(recipe, impl, mesh)


def make_optimizer(recipe: Recipe, model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum. Sharded (``DTensor``) and plain parameters (``ignored_params``) go in
    two groups: on an accelerator SGD's default multi-tensor step refuses a list that mixes
    them. The update of each parameter is the same either way."""
    params = list(model.parameters())
    groups = [[p for p in params if isinstance(p, DTensor) is sharded] for sharded in (True, False)]
    groups = [{"params": g} for g in groups if g]
    return torch.optim.SGD(groups, lr=recipe.lr, momentum=0.9)


def _train(
    recipe: Recipe,
    model: nn.Module,
    master: nn.Module | None,
    rank: int,
    world: int,
    low: torch.dtype | None,
    opt: torch.optim.Optimizer | None = None,
    low_world: int = 1,
) -> Trace:
    opt = opt or make_optimizer(recipe, model)
    trace = Trace(optimizer=opt)
    for step in range(recipe.steps):
        loss_sum = torch.zeros((), device=DEVICE)
        unreduced = {} if recipe.low_accumulate else None  # slice -> its gradients so far
        for micro in range(recipe.micro):
            index = (recipe.start + step) * recipe.micro + micro
            batch = _slice(recipe.data(index), rank, world)
            last = micro == recipe.micro - 1
            if recipe.on_micro is not None and master is None:
                recipe.on_micro(model, micro, last)
            if low is not None:
                loss = _low_precision_backward(
                    recipe, model, batch, low, low_world, unreduced, last
                )
            else:
                loss = recipe.loss(model, batch)
                loss.backward()
            loss_sum += loss.detach().float()
        if master is None:  # sharded: the global loss is the mean over ranks
            dist.all_reduce(loss_sum)
            loss_sum /= dist.get_world_size()  # ranks of one TP group count their slice alike
        trace.losses.append(loss_sum / recipe.micro)
        if recipe.before_step is not None and master is None:
            recipe.before_step(model)
        if recipe.clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(
                model.parameters(), recipe.clip, norm_type=recipe.norm_type
            )
            trace.norms.append(_float(norm))
        named = dict(model.named_parameters())
        trace.grads.append({n: _local(p.grad) for n, p in named.items()})
        opt.step()
        opt.zero_grad(set_to_none=recipe.zero_grad_set_to_none(step))
        trace.params.append({n: _local(p) for n, p in named.items()})
        trace.placements = {n: p for n, p in named.items() if isinstance(p, DTensor)}
    return trace


def _low_precision_backward(
    recipe: Recipe,
    master: nn.Module,
    batch: tuple,
    low: torch.dtype,
    world: int,
    unreduced: dict | None = None,
    last: bool = True,
) -> torch.Tensor:
    """Each of ``world`` slices computes in a ``low`` copy of the model; gradients are
    averaged over slices in ``recipe.low_reduce`` and added to the fp32 master's. With
    ``unreduced`` (``recipe.low_accumulate``), each slice first adds its gradients to its own
    sum there, in ``low_reduce``, and only the ``last`` micro-batch averages those sums."""
    work = copy.deepcopy(master).to(low)
    # Cast the model's floating-point inputs where the root module begins, as
    # cast_forward_inputs does (the loss's own targets stay in full precision).
    work.register_forward_pre_hook(lambda module, args: cast_floats(args, low))
    losses, sums = [], None
    for r in range(world):
        part = _slice(batch, r, world)
        work.zero_grad(set_to_none=True)
        loss = recipe.loss(work, part)
        loss.backward()
        losses.append(loss.detach().float())
        grads = [
            None if q.grad is None else q.grad.to(recipe.low_reduce) for q in work.parameters()
        ]
        if unreduced is not None:  # accumulated on the rank, in the reduce dtype
            grads = _add(unreduced.get(r), grads)
            unreduced[r] = grads
        sums = _add(sums, grads)
    if not last and unreduced is not None:
        return torch.stack(losses).mean()
    for p, g in zip(master.parameters(), sums):
        if g is not None:
            g = (g / world).float()
            p.grad = g if p.grad is None else p.grad + g
    return torch.stack(losses).mean()


def cast_floats(args: tuple, dtype: torch.dtype) -> tuple:
    """``args`` with each floating-point tensor in ``dtype`` (a module's inputs, cast)."""
    return tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def _add(sums: list | None, grads: list) -> list:
    """Element-wise sum of two gradient lists (None: no gradient)."""
    if sums is None:
        return grads
    return [a if b is None else (b if a is None else a + b) for a, b in zip(sums, grads)]


def _cut(plain: Trace, t: torch.Tensor | None, dt: DTensor | None) -> torch.Tensor | None:
    """A full tensor ``t`` of the plain run ``plain`` cut down to this rank's block of ``dt``,
    once per tensor and placements (DTensor's slicing costs about a fifth of a millisecond, and
    each plain tensor is cut for every run and case compared with it); kept with its tensor, so
    that its id stays its own."""
    if t is None or dt is None:
        return t
    key = (id(t), dt.device_mesh, tuple(dt.placements))
    if key not in plain.pieces:
        plain.pieces[key] = (t, local_rows(t, dt))
    return plain.pieces[key][1]


def compare(
    checker: Checker,
    label: str,
    run: Trace,
    truth: Trace,
    truth_low: Trace | None = None,
    other: Trace | None = None,
) -> None:
    """Compare a sharded run with the plain truth on this rank's blocks, or, with ``other``
    (another sharded run with the same placements), with that run, judged against the truth.
    The comparisons use no streams: the stand-in streams' checks pause for them."""
    with paused():
        _compare(checker, label, run, truth, truth_low, other)


def _compare(checker, label, run, truth, truth_low, other) -> None:
    for step, loss in enumerate(run.losses):
        low = truth_low.losses[step] if truth_low else None
        expected = other.losses[step] if other else truth.losses[step]
        checker.close(f"{label} step {step} loss", loss, expected, low, truth.losses[step])
        if run.norms:
            low = truth_low.norms[step] if truth_low else None
            expected = other.norms[step] if other else truth.norms[step]
            checker.close(
                f"{label} step {step} grad norm", run.norms[step], expected, low, truth.norms[step]
            )
        for kind in ("grads", "params"):
            mine, true = getattr(run, kind)[step], getattr(truth, kind)[step]
            true_low = getattr(truth_low, kind)[step] if truth_low else None
            if set(mine) != set(true):
                checker.fail(f"{label} {kind}: names {sorted(set(mine) ^ set(true))} differ")
                continue
            for name, value in mine.items():
                dt = run.placements.get(name)
                whole = _cut(truth, true[name], dt)
                expected = getattr(other, kind)[step].get(name) if other else whole
                low = _cut(truth_low, true_low[name], dt) if true_low else None
                checker.close(
                    f"{label} step {step} {kind[:-1]} '{name}'", value, expected, low, whole
                )
