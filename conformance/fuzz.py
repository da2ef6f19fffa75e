"""Fuzzed parity: random models, meshes, policies and accumulation patterns, each trained by
the plain model, ``twinshard.reference`` and ``twinshard.optimized`` and compared step by step.

An ``Example`` is plain data (JSON in, JSON out), so that it can be drawn in one process, run in
the ranks of another and printed as the one line that reproduces a failure. Its model,
``FuzzNet``, is ``inp -> blocks -> out``: square ``inp``/``out`` layers of the data width (tied
when ``tie``) around a chain of blocks of uneven widths (``Linear`` of 1, 7 or 37 rows, fewer
rows than ranks, optional bias and ``LayerNorm``), some sharded as their own group, some frozen.
A block may scale its input by a frozen vector in another dtype (bf16, float8), so that its
group holds parameters of two dtypes. Every group draws its own ``reshard_after_forward``
(bool, int or the default) and CPU offload; the model one mixed-precision policy; each step
several micro-batches, with gradient sync, resharding after backward and HSDP's all-reduce
switched off on some of them; after each optimizer step, optionally, the root is handed an
event recorded after the step (``set_post_optim_event``) and the model's own state dict is
loaded back with ``assign=True``, so that every parameter is a new ``DTensor`` (in new memory,
or in the old) that the next all-gather must adopt.

With ``stand_in``, the second implementation (the optimized path) runs its accelerator schedule
on stand-in streams with the stream sanitizer on (``twinshard/dispatch/standin.py``), as ``twinshard
conform --stand-in-streams`` runs the cases: a read before its wait or a buffer released too
early fails the example with the sanitizer's report (the ranks stop, and the launch names the
example), and the values are compared as in any other example.

Nothing here compares by itself: ``check_example`` is ``conformance.driver``'s ``run_plain``,
``run_sharded`` and ``compare`` with ``conformance.compare.Checker``'s tolerance classes, as in
``cases.core.train_case`` (within twice the plain model's own error of the same data-parallel
computation; the optimized path bitwise equal to the reference in fp32 at world size <= 2).
``run_examples`` runs a list of examples inside one process group (launching one per example
would cost more than the examples); ``fuzz_draw`` draws them with hypothesis.

[Note: fp32 judged like low precision]
The suite's cases compare fp32 runs with ``assert_close``'s defaults. A drawn model can be
ill-conditioned enough (a 1-row layer feeding a 37-wide ``LayerNorm``, three steps of momentum)
that merely summing the ranks' gradients in another order moves a gradient 3e-5 off the
full-batch truth: the plain model does the same when it computes the data-parallel way. So
fp32 examples are judged like low-precision ones, with fp32 as the low dtype: within twice
the plain model's own data-parallel fp32 error, plus one fp32 rounding (at least ``atol``).
For a well-conditioned model that is as strict as the defaults; a wrong scale still fails.

[Note: one step in low precision]
Low-precision examples train one step. From the second step on, the plain model's fp32 master
weights and the implementation's differ by a rounding, and where a weight sits near a bf16
rounding boundary their bf16 copies differ by a whole bf16 step: the next gradients part by
that step times the model's sensitivity, in another direction for each computation. A bound
taken from one such realization (the plain model's) is then no bound for the other; the fuzzer
found a model 3x past it at step 3 with both implementations bitwise equal. Within the first
step both start from the same weights, so the rule holds; the suite's fixed cases train longer.
With gradient sync off, FSDP adds a rank's micro-batch gradients up unreduced, in the reduce
dtype; the oracle does the same (``Recipe.low_accumulate``), or a bf16 sum of three
micro-batches on 3 ranks errs 3x past the plain model's fp32 sum (found by the long run).
"""

from __future__ import annotations

import importlib
import json
import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from .compare import Checker
from .driver import Recipe, compare, run_plain, run_sharded, set_device
from .fuzz_streams import reloads_after_steps, stand_in_streams
from .models import GLOBAL_BATCH, batches, mse
from .runner import _merge_ranks

# name -> (param_dtype, reduce_dtype, output_dtype of the root)
POLICIES = {
    "fp32": (None, None, None),
    "bf16/fp32": ("bfloat16", "float32", None),
    "bf16/bf16": ("bfloat16", "bfloat16", None),
    "bf16/default": ("bfloat16", None, None),
    "bf16/fp32/out-fp32": ("bfloat16", "float32", "float32"),
}
SYNC_OFF = ("model", "root_only", "blocks", "reshard_after_backward", "all_reduce")
SCALE_DTYPES = ("bfloat16", "float8_e4m3fn")  # a block's frozen scale, beside fp32 weights
RELOADS = ("new_memory", "same_memory")  # the assign-loaded DTensors: cloned, or the state dict's


@dataclass(frozen=True)
class Example:
    """One random training run. Lists have one entry per block, or per group (``reshard``,
    ``offload``: the blocks sharded on their own, in order, then the root)."""

    mesh: tuple  # (world,) FSDP, or (replicas, shards) HSDP
    widths: tuple  # data width, then each block's output width; the last is the data width
    bias: tuple  # per block
    norm: tuple  # per block: a LayerNorm after its Linear
    own_group: tuple  # per block: fully_shard it separately (else it is in the root's group)
    frozen: tuple  # per block: its Linear weight does not train
    tie: bool = False  # out.weight is inp.weight
    frozen_inp: bool = False  # inp does not train (nor out.weight, when tied)
    reshard: tuple = ()  # per group: None (default), True, False or an int
    offload: tuple = ()  # per group: CPUOffloadPolicy
    policy: str = "fp32"  # a key of POLICIES, for every group
    micro: int = 1  # micro-batches per step
    sync_off: tuple = ()  # per micro-batch but the last: what it switches off (SYNC_OFF)
    steps: int = 2
    clip: float | None = None  # clip_grad_norm_ max norm
    name: str = ""  # a regression case's name
    scale: tuple = ()  # per block: None, or the dtype (SCALE_DTYPES) of a frozen input scale
    reload: str | None = None  # after each step: post-optim event, then an assign-load (RELOADS)
    stand_in: bool = False  # the optimized path on stand-in streams, under the sanitizer

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Example:
        data = json.loads(text)
        for f in fields(cls):  # JSON gives lists back; the dataclass holds tuples
            if isinstance(data.get(f.name), list):
                data[f.name] = tuple(data[f.name])
        return cls(**data)

    @property
    def world(self) -> int:
        return math.prod(self.mesh)

    @property
    def low_precision(self) -> bool:
        return POLICIES[self.policy][0] is not None


class Block(nn.Module):
    """``tanh(norm(lin(x * scale)))``: one layer of uneven width; ``scale``, when it has one,
    is a frozen vector in another dtype (the group then holds two dtypes)."""

    def __init__(self, d_in: int, d_out: int, bias: bool, norm: bool, scale: str | None = None):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out, bias=bias)
        self.norm = nn.LayerNorm(d_out) if norm and d_out > 1 else None
        self.scale = None
        if scale is not None:
            values = (1 + 0.1 * torch.randn(d_in)).to(_dtype(scale))  # (d_in,)
            self.scale = nn.Parameter(values, requires_grad=False)

    def forward(self, x):
        if self.scale is not None:
            x = x * self.scale.to(x.dtype)  # (B, d_in)
        x = self.lin(x)  # (B, d_out)
        return torch.tanh(self.norm(x) if self.norm is not None else x)


class FuzzNet(nn.Module):
    """``out(blocks(inp(x)))`` with the structure an ``Example`` describes."""

    def __init__(self, ex: Example):
        super().__init__()
        d = ex.widths[0]
        self.inp = nn.Linear(d, d)
        pairs = zip(ex.widths[:-1], ex.widths[1:])
        scales = ex.scale or (None,) * len(ex.bias)
        self.blocks = nn.ModuleList(
            Block(a, b, bias, norm, scale)
            for (a, b), bias, norm, scale in zip(pairs, ex.bias, ex.norm, scales)
        )
        self.out = nn.Linear(d, d)  # its bias trains even when every other weight is frozen
        if ex.tie:
            self.out.weight = self.inp.weight
        for block, frozen in zip(self.blocks, ex.frozen):
            block.lin.weight.requires_grad_(not frozen)
        if ex.frozen_inp:
            self.inp.requires_grad_(False)

    def forward(self, x):
        x = self.inp(x)  # (B, d)
        for block in self.blocks:
            x = block(x)  # (B, width)
        return self.out(x)  # (B, d)


def _dtype(name: str | None) -> torch.dtype | None:
    return getattr(torch, name) if name else None


def _group_options(impl, ex: Example, group: int, root: bool) -> dict:
    param, reduce, output = (_dtype(n) for n in POLICIES[ex.policy])
    options = {}
    if ex.policy != "fp32":
        options["mp_policy"] = impl.MixedPrecisionPolicy(
            param_dtype=param, reduce_dtype=reduce, output_dtype=output if root else None
        )
    if ex.reshard[group] is not None:
        options["reshard_after_forward"] = ex.reshard[group]
    if ex.offload[group]:
        options["offload_policy"] = impl.CPUOffloadPolicy(pin_memory=False)
    return options


def recipe(ex: Example, wrapped: dict | None = None) -> Recipe:
    """The driver's recipe for ``ex``: build, wrap, data and the per-micro-batch switches.
    ``wrapped["model"]`` is set to each model the recipe wraps."""

    def wrap(impl, model, mesh):
        if wrapped is not None:
            wrapped["model"] = model
        group = 0
        for block, own in zip(model.blocks, ex.own_group):
            if own:
                impl.fully_shard(block, mesh=mesh, **_group_options(impl, ex, group, False))
                group += 1
        impl.fully_shard(model, mesh=mesh, **_group_options(impl, ex, group, True))

    def on_micro(model, micro, last):
        model.set_requires_gradient_sync(True)  # everything on, then this micro-batch's switch
        model.set_reshard_after_backward(True)
        model.set_is_last_backward(True)
        model.set_requires_all_reduce(True)
        what = None if last else ex.sync_off[micro]
        if what == "model":
            model.set_requires_gradient_sync(False)
        elif what == "root_only":
            model.set_requires_gradient_sync(False, recurse=False)
        elif what == "blocks":
            sharded = [b for b, own in zip(model.blocks, ex.own_group) if own]
            for block in sharded[::2]:
                block.set_requires_gradient_sync(False, recurse=False)
        elif what == "reshard_after_backward":
            model.set_requires_gradient_sync(False)
            model.set_reshard_after_backward(False)
            model.set_is_last_backward(False)
        elif what == "all_reduce":
            model.set_requires_all_reduce(False)

    d = ex.widths[0]
    low, reduce, _ = POLICIES[ex.policy]
    pair = lambda g: (
        torch.randn(GLOBAL_BATCH, d, generator=g),
        torch.randn(GLOBAL_BATCH, d, generator=g),
    )  # noqa: E731
    return Recipe(
        build=lambda: FuzzNet(ex),
        wrap=wrap,
        data=batches(pair),
        loss=mse,
        steps=ex.steps,
        micro=ex.micro,
        on_micro=on_micro,
        clip=ex.clip,
        low_precision=_dtype(low),
        low_reduce=_dtype(reduce or low) or torch.float32,
        low_accumulate=any(what is not None for what in ex.sync_off),
    )


IMPLS = ("twinshard.reference", "twinshard.optimized")


def check_example(ex: Example, mesh, impls: tuple = IMPLS) -> Checker:
    """The plain model and both ``impls`` on ``ex``, compared every step (see the module doc);
    the second is also compared with the first, bitwise where the reduction order is the same.
    With ``ex.stand_in`` the second runs on stand-in streams under the sanitizer."""
    first, second = (importlib.import_module(name) for name in impls)
    labels = [name.rsplit(".", 1)[-1] for name in impls]
    wrapped: dict = {}
    r = recipe(ex, wrapped)
    low = r.low_precision or torch.float32  # see [Note: fp32 judged like low precision]
    checker = Checker("low_precision", low_eps=torch.finfo(low).eps)
    truth = run_plain(r)
    truth_low = run_plain(r, low=low, world=ex.world)
    with reloads_after_steps(ex.reload, wrapped):
        one, _ = run_sharded(r, first, mesh)
        compare(checker, labels[0], one, truth, truth_low)
        with stand_in_streams(ex.stand_in):
            two, _ = run_sharded(r, second, mesh)
    compare(checker, labels[1], two, truth, truth_low)
    exact = not ex.low_precision and ex.world <= 2  # the same reduction order: the same bits
    against = Checker("bitwise" if exact else "low_precision", low_eps=checker.low_eps)
    compare(against, f"{labels[1]} vs {labels[0]}", two, truth, truth_low, other=one)
    checker.absorb(against)
    return checker


def run_examples(texts: list[str], mesh_shape: tuple, impls: tuple = IMPLS) -> list[dict]:
    """Run in every rank of one process group: check each example (JSON) on one mesh and
    return the verdicts, merged over ranks (an example passes only if it passed everywhere)."""
    set_device(torch.device("cpu"))
    names = ("replicate", "shard")[-len(mesh_shape) :]
    mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=names)
    verdicts = []
    for text in texts:
        try:
            summary = check_example(Example.from_json(text), mesh, impls).summary()
        except Exception as e:  # one rank's exception would leave the others in a collective
            # (a StreamOrderError too: a rank whose shard is empty may not see the access)
            raise RuntimeError(f"example {text} raised {type(e).__name__}: {e}") from e
        verdicts.append({**_merge_ranks(summary), "example": text})
    return verdicts
