"""A memory model: the peak bytes per rank that FSDP itself holds, predicted from sizes alone.

``groups_of`` turns a model (the meta device will do) into ``Group``s of parameter shapes: the
root, then one per block. ``_Sizes`` derives from a group, a shard group size and the two
dtypes every buffer a hook can hold (padded shard, unsharded weights, packed gradients,
reduced block, gradients per parameter). ``_Timeline`` is the allocator: ``alloc`` and
``free`` by key, recording the categories at the largest sum. ``_reference``, ``_optimized``
and ``_torch`` each replay one steady-state step of that implementation's schedule on a
timeline, and ``predict`` runs the one asked for; ``predict_replicated`` gives the plain model
and DDP, which hold no FSDP state, and ``for_job`` picks between them for a bench job. The
categories are ``probe.CATEGORIES``, so a prediction and a measurement compare key by key; a
replay function must free every buffer at the point the implementation does, not at the end
of its group, or the peak moves.

The schedules, the sizes and how to read the prediction beside the measurement:
docs/benchmarks.md, "The memory model".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .probe import CATEGORIES


@dataclass
class Group:
    """One parameter group's parameters, as shapes; ``late`` marks the parameters whose
    gradient comes last in backward (the root's input embedding)."""

    name: str
    shapes: list
    late: list | None = None


def groups_of(model: torch.nn.Module) -> list[Group]:
    """The root group (parameters outside ``model.blocks``) and one group per block, from a
    model built on any device (the meta device will do)."""
    in_blocks = {id(p) for p in model.blocks.parameters()}
    root, late = [], []
    for name, p in model.named_parameters():
        if id(p) not in in_blocks:
            root.append(tuple(p.shape))
            late.append(isinstance(_owner(model, name), torch.nn.Embedding))
    blocks = [
        Group(f"blocks.{i}", [tuple(p.shape) for p in b.parameters()])
        for i, b in enumerate(model.blocks)
    ]
    return [Group("root", root, late)] + blocks


def _owner(model, name):
    return model.get_submodule(name.rpartition(".")[0]) if "." in name else model


class _Sizes:
    def __init__(self, group: Group, S: int, pb: int, rb: int):
        chunks = [(math.ceil(s[0] / S), math.prod(s[1:])) for s in group.shapes]
        self.block = sum(c * rest for c, rest in chunks)  # per-rank numel, padded
        self.sharded = self.block * 4
        self.unsharded = S * self.block * pb
        self.packed = S * self.block * rb
        self.out = self.block * rb
        late = group.late or [False] * len(group.shapes)
        numel = [math.prod(s) for s in group.shapes]
        self.grad_late = sum(n for n, x in zip(numel, late) if x) * pb
        self.grad = sum(numel) * pb - self.grad_late  # the early ones (all, for a block)
        # per parameter: (key, unsharded gradient, reduced block, sharded block, late)
        self.params = [
            (k, n * pb, c * rest * rb, c * rest * 4, x)
            for k, (n, (c, rest), x) in enumerate(zip(numel, chunks, late))
        ]
        if S == 1:  # one rank: nothing to communicate, so no buffers (torch's FSDP2 neither)
            self.packed = self.out = 0
            self.params = [(k, g, 0, b, x) for k, g, _, b, x in self.params]


class _Timeline:
    def __init__(self, persistent: dict):
        self.alive: dict = {}
        self.persistent = persistent
        self.peak_total, self.peak = -1, {}

    def alloc(self, key, category: str, nbytes: int) -> None:
        self.alive[key] = (category, nbytes)
        now = dict(self.persistent)
        for cat, n in self.alive.values():
            now[cat] = now.get(cat, 0) + n
        total = sum(now.values())
        if total > self.peak_total:
            self.peak_total, self.peak = total, now

    def free(self, *keys) -> None:
        for key in keys:
            self.alive.pop(key, None)


def predict(
    groups: list[Group],
    impl: str,
    world: int,
    pb: int = 4,
    rb: int | None = None,
    gloo: bool = False,
) -> dict:
    """Peak bytes by category of one steady-state step on rank 0 (the schedules:
    docs/benchmarks.md, "The memory model").
    ``gloo``: a gloo run without HSDP, where ``optimized`` all-reduces the packed gradients in
    place and its reduced block (out) is a view of them."""
    rb = rb or pb
    sizes = [_Sizes(g, world, pb, rb) for g in groups]
    if gloo and impl == "optimized":
        for s in sizes:
            s.out = 0
    sharded = sum(s.sharded for s in sizes)
    t = _Timeline({"sharded": sharded, "optimizer": sharded})
    step = {"reference": _reference, "optimized": _optimized, "torch": _torch}.get(impl)
    if step is None:
        raise ValueError(f"no memory model for {impl!r}")
    step(t, sizes)
    return {c: t.peak.get(c, 0) for c in CATEGORIES}


def _reference(t: _Timeline, sizes: list) -> None:
    root, blocks = sizes[0], sizes[1:]
    t.alloc("U0", "unsharded", root.unsharded)
    for i, b in enumerate(blocks, 1):
        t.alloc(f"U{i}", "unsharded", b.unsharded)
        t.free(f"U{i}")

    def grads(i, late: bool):
        for k, grad, _, _, x in sizes[i].params:
            if x == late:
                t.alloc(f"G{i}.{k}", "grad", grad)

    def reduce(i):  # one parameter at a time: its reduced block becomes its sharded gradient
        for k, _, out, block, _ in sizes[i].params:
            t.alloc(f"out{i}.{k}", "comm", out)
            t.free(f"out{i}.{k}")
            t.alloc(f"SG{i}.{k}", "sharded_grad", block)
            t.free(f"G{i}.{k}")

    grads(0, late=False)
    for i in range(len(blocks), 0, -1):
        t.alloc(f"U{i}", "unsharded", sizes[i].unsharded)
        grads(i, late=False)
        t.free(f"U{i}")  # resharded before the reduction
        reduce(i)
    grads(0, late=True)
    t.free("U0")
    reduce(0)


def _optimized(t: _Timeline, sizes: list) -> None:
    root, blocks = sizes[0], sizes[1:]
    n = len(blocks)

    def gather(i):  # copy-in into this rank's slot of the output, and all-gather of group i
        t.alloc(f"recv{i}", "comm", sizes[i].unsharded)

    def copy_out(i):  # into the parameters; the buffers go right after
        t.alloc(f"U{i}", "unsharded", sizes[i].unsharded)
        t.free(f"recv{i}")

    def reduce(i, prev):
        if prev is not None:  # finish the previous group's reduction; its buffers go
            t.free("rs_packed", "rs_out")
            t.alloc(f"SG{prev}", "sharded_grad", sizes[prev].sharded)
        t.alloc("rs_packed", "comm", sizes[i].packed)
        t.free(f"G{i}", f"G{i}late")  # dropped once packed
        t.alloc("rs_out", "comm", sizes[i].out)

    gather(0)
    copy_out(0)
    if n:
        gather(1)  # the root's pre-forward prefetches the first block
    for i in range(1, n + 1):
        if i < n:
            gather(i + 1)  # prefetched before block i is copied out
        copy_out(i)
        t.free(f"U{i}")
    if n:
        gather(n)  # the root's pre-backward prefetches the last block
    t.alloc("G0", "grad", root.grad)
    prev = None
    for i in range(n, 0, -1):
        copy_out(i)
        if i > 1:
            gather(i - 1)
        t.alloc(f"G{i}", "grad", sizes[i].grad)
        t.free(f"U{i}")  # resharded before the reduction
        reduce(i, prev)
        prev = i
    t.alloc("G0late", "grad", root.grad_late)
    t.free("U0")
    reduce(0, prev)
    t.free("rs_packed", "rs_out")
    t.alloc("SG0", "sharded_grad", root.sharded)


def _torch(t: _Timeline, sizes: list) -> None:
    root, blocks = sizes[0], sizes[1:]
    n = len(blocks)

    def unshard(i):  # in place into one buffer, copied out, dropped
        t.alloc("recv", "comm", sizes[i].unsharded)
        t.alloc(f"U{i}", "unsharded", sizes[i].unsharded)
        t.free("recv")

    def reduce(i):  # reshard first, then pack the gradients and drop them
        t.free(f"U{i}", "rs_packed")
        t.alloc("rs_packed", "comm", sizes[i].packed)
        t.free(f"G{i}", f"G{i}late")
        t.alloc(f"SG{i}", "sharded_grad", sizes[i].sharded)

    unshard(0)
    for i in range(1, n + 1):
        unshard(i)
        t.free(f"U{i}")
    if n:  # backward prefetch: the root's pre-backward issues the last block's all-gather
        t.alloc("recv", "comm", sizes[n].unsharded)
    t.alloc("G0", "grad", root.grad)
    for i in range(n, 0, -1):
        t.alloc(f"U{i}", "unsharded", sizes[i].unsharded)  # copy-out of the prefetched gather
        t.free("recv")
        if i > 1:
            t.alloc("recv", "comm", sizes[i - 1].unsharded)  # the next group's, in flight
        t.alloc(f"G{i}", "grad", sizes[i].grad)
        reduce(i)
    t.alloc("G0late", "grad", root.grad_late)
    reduce(0)


def tracked(categories: dict) -> int:
    """The bytes FSDP adds on top of the persistent state: unsharded, grad, comm, sharded
    gradients."""
    return sum(categories.get(c, 0) for c in ("unsharded", "grad", "comm", "sharded_grad"))


def predict_replicated(groups: list[Group], impl: str, pb: int = 4) -> dict:
    """``plain`` (parameters, gradients, momentum) and ``ddp`` (plus its gradient buckets, one
    flat copy of every gradient)."""
    numel = sum(math.prod(s) for g in groups for s in g.shapes)
    out = dict.fromkeys(CATEGORIES, 0)
    out.update(params=numel * pb, grad=numel * pb, optimizer=numel * pb)
    if impl == "ddp":
        out["comm"] = numel * pb
    return out


def for_job(job) -> dict | None:
    """The prediction for ``job`` (a ``twinshard.measure.job.Job``) on rank 0: its model's
    groups, its implementation, shard group and dtypes; None for an implementation the model
    does not know (a module from outside the project)."""
    from twinshard.measure.job import BASELINES, SHARDED
    from twinshard.models import Llama

    with torch.device("meta"):
        groups = groups_of(Llama(job.llama()))
    pb = 2 if job.low_precision is not None else 4
    if job.impl in BASELINES:
        return predict_replicated(groups, job.impl, pb)
    if job.impl not in SHARDED:
        return None
    gloo = job.backend == "gloo" and job.replicas == 1
    return predict(groups, job.impl, job.world // job.replicas, pb, 4, gloo)
