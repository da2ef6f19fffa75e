"""Cost cases: what an implementation communicates and keeps alive, per setting.

Each case shards the same small model (a token embedding, three MLP blocks and a root with a
norm and a head: five groups, uneven sizes), trains one step so that an implementation that
learns the order of its groups knows it, and records the micro-batches of the second step with
``twinshard.measure.schedule.Recorder``. Every micro-batch is held to the cost contract
(``twinshard.conformance.contract``): the collectives per pass, kind and group, and the
unsharded parameters and gradients alive after every hook. The same recording of the
reference and of torch's ``fully_shard`` (the oracles, where the run has them) is held to the
same contract, and their counts go into the case's notes beside the implementation's: a
place where an oracle breaks the contract is reported there, not failed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from twinshard.measure.schedule import Recorder
from twinshard.models import MLPBlock

from ..compare import Checker
from ..contract import Plan, expected, group_specs, with_pieces
from ..contract_check import check_collectives, counts, due_collectives, seen_collectives
from ..contract_memory import check_memory
from .core import case

VOCAB, DIM, HIDDEN, BLOCKS = 37, 15, 37, 3
PATHS = ["tok", *(f"blocks.{i}" for i in range(BLOCKS)), ""]  # sharded bottom-up, root last


class EmbedMLP(nn.Module):
    """Token embedding -> MLP blocks -> norm -> head. The embedding's backward needs no
    weights (``set_unshard_in_backward(False)`` applies), and its inputs need no gradient, so
    its post-backward comes at the end of backward, as the root's does."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(MLPBlock(DIM, HIDDEN) for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)  # (B, dim)
        for block in self.blocks:
            x = block(x)  # (B, dim)
        return self.head(self.norm(x))  # (B, 4)


def build() -> EmbedMLP:
    torch.manual_seed(0)
    return EmbedMLP()


def shard(impl, model: nn.Module, mesh, settings: dict | None = None, paths=PATHS, **kwargs):
    """``fully_shard`` on the embedding, each block, then the root; ``settings`` per path."""
    for path in paths:
        extra = {**kwargs, **(settings or {}).get(path, {})}
        impl.fully_shard(model.get_submodule(path), mesh=mesh, **extra)


def record(ctx, impl, plan: Plan, wrap, on_micro=None) -> list:
    """Train one step, record the micro-batches of the second: one ``Schedule`` each."""
    model = build()
    wrap(impl, model, ctx.mesh)
    recorder = Recorder(model, getattr(impl, "__name__", str(impl)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    recorded = []
    try:
        for step in range(2):
            for m in range(plan.micro):
                if on_micro is not None:
                    on_micro(model, m, m == plan.micro - 1)
                g = torch.Generator().manual_seed(1000 * step + 100 * dist.get_rank() + m)
                ids = torch.randint(0, VOCAB, (15,), generator=g).to(ctx.device)  # (B,)
                if step == 0:
                    model(ids).float().square().mean().backward()
                    continue
                with recorder:
                    model(ids).float().square().mean().backward()
                recorded.append(recorder.schedule)
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        recorder.remove()
    return recorded


def judge(plan: Plan, schedules: list, checker: Checker, label: str) -> str:
    """Hold recorded micro-batches to the contract; returns their counts for the notes."""
    lines = []
    if schedules:  # groups the implementation cut in pieces are held as groups of their own
        plan = with_pieces(plan, build(), schedules[0].groups)
    for m, (steps, schedule) in enumerate(zip(expected(plan), schedules)):
        where = f"{label}, {plan.label}, micro-batch {m + 1} of {plan.micro}"
        seen = seen_collectives(plan, schedule)
        check_collectives(checker, plan, where, due_collectives(plan, steps), seen)
        peaks = check_memory(checker, plan, where, steps, schedule, seen)
        lines.append(
            f"{counts(seen)}, peak unsharded {peaks['unsharded']} B, grads {peaks['grads']} B"
        )
    if len(schedules) != plan.micro:
        checker.fail(f"{label}: {len(schedules)} micro-batches recorded of {plan.micro}")
    return f"{label}: " + "; ".join(lines)


def _ranks_agree(checker: Checker, schedules: list) -> None:
    mine = [[(c.op, c.dtype, c.nbytes, c.ranks) for c in s.collectives] for s in schedules]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    checker.count += 1
    for rank, theirs in enumerate(every):
        if theirs != every[0]:
            checker.fail(
                f"rank {rank} issued other collectives than rank 0: {theirs} vs {every[0]}"
            )
            break


def cost_case(ctx, plan: Plan, wrap, on_micro=None) -> Checker:
    """Record and judge the implementation under test, then the oracles (their verdicts go
    into the notes)."""
    checker = Checker("fp32")
    schedules = record(ctx, ctx.impl, plan, wrap, on_micro)
    _ranks_agree(checker, schedules)
    checker.notes.append(judge(plan, schedules, checker, ctx.impl_name))
    for label, oracle in (("reference", ctx.reference), ("torch", ctx.oracle)):
        if oracle is None:
            continue
        theirs = Checker("fp32")
        note = judge(plan, record(ctx, oracle, plan, wrap, on_micro), theirs, label)
        checker.notes.append(note)
        if theirs.failures:
            checker.notes.append(f"{label} breaks the contract: {theirs.failures[0]}")
    return checker


def plan_for(ctx, label: str, settings: dict | None = None, paths=PATHS, **fields) -> Plan:
    """A plan for the model as ``shard`` wraps it."""
    return Plan(label, group_specs(build(), paths, settings), ctx.mesh_shape, **fields)


def _all(value):
    return {path: {"reshard_after_forward": value} for path in PATHS}


# --- the cases --------------------------------------------------------------------------------
@case("cost")
def case_cost_default(ctx):
    """Default: blocks and embedding gathered in forward and again in backward, the root once;
    one reduction per group; at most the root, the group computing and one prefetched group
    unsharded after any hook; gradients of one group in flight beside the one computing."""
    return cost_case(ctx, plan_for(ctx, "default"), shard)


@case("cost")
def case_cost_root_embedding(ctx):
    """The embedding left to the root (torch's default grouping): the root holds the
    embedding, the norm and the head, which an implementation may gather and reduce in pieces
    (``twinshard.optimized.in_pieces``), each piece held as a group of the root's settings."""
    paths = PATHS[1:]  # the blocks, then the root
    plan = plan_for(ctx, "the embedding in the root's group", paths=paths)
    return cost_case(ctx, plan, lambda impl, m, mesh: shard(impl, m, mesh, paths=paths))


@case("cost")
def case_cost_reshard_false(ctx):
    """reshard_after_forward=False: every group gathered once, in forward, and kept
    unsharded until its post-backward."""
    plan = plan_for(ctx, "reshard_after_forward=False", _all(False))

    def wrap(impl, model, mesh):
        shard(impl, model, mesh, reshard_after_forward=False)

    return cost_case(ctx, plan, wrap)


@case("cost")
def case_cost_reshard_true_root(ctx):
    """reshard_after_forward=True given explicitly: the root is resharded after forward too,
    and gathered again in backward."""
    plan = plan_for(ctx, "reshard_after_forward=True", _all(True))

    def wrap(impl, model, mesh):
        shard(impl, model, mesh, reshard_after_forward=True)

    return cost_case(ctx, plan, wrap)


@case(
    "cost",
    needs=lambda ctx: ctx.shard_size % 2 == 0 and ctx.shard_size > 2,
    why="needs a shard group of 4 or more (even), where 2 differs from True",
)
def case_cost_reshard_int(ctx):
    """reshard_after_forward=2: the backward all-gather runs over 2 ranks, from the 1/2
    pieces kept after forward (no unsharded memory between forward and backward)."""
    plan = plan_for(ctx, "reshard_after_forward=2", _all(2))

    def wrap(impl, model, mesh):
        shard(impl, model, mesh, reshard_after_forward=2)

    return cost_case(ctx, plan, wrap)


@case("cost")
def case_cost_no_sync(ctx):
    """set_requires_gradient_sync(False) on the root for 2 of 3 micro-batches: no reduction
    on those, one per group on the last; gradients wait unreduced."""
    plan = plan_for(ctx, "no gradient sync before the last of 3", micro=3)
    plan.sync = lambda path, m: m == 2

    def on_micro(model, m, last):
        model.set_requires_gradient_sync(last)

    return cost_case(ctx, plan, shard, on_micro)


@case("cost")
def case_cost_no_sync_some(ctx):
    """Blocks 0 and 2 skip gradient sync on the first of 2 micro-batches (recurse=False);
    every other group reduces on both."""
    plan = plan_for(ctx, "no sync for blocks 0 and 2 on micro-batch 1", micro=2)
    plan.sync = lambda path, m: m == 1 or path not in ("blocks.0", "blocks.2")

    def on_micro(model, m, last):
        for block in (model.blocks[0], model.blocks[2]):
            block.set_requires_gradient_sync(last, recurse=False)

    return cost_case(ctx, plan, shard, on_micro)


@case("cost")
def case_cost_last_backward(ctx):
    """set_requires_gradient_sync, set_reshard_after_backward and set_is_last_backward off
    for 2 of 3 micro-batches: no reduction there, parameters kept unsharded from one backward
    into the next forward (which gathers nothing), one reduction per group on the last."""
    plan = plan_for(ctx, "accumulating unsharded for 2 of 3", micro=3)
    plan.sync = plan.reshard_after_backward = lambda path, m: m == 2

    def on_micro(model, m, last):
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)
        model.set_is_last_backward(last)

    return cost_case(ctx, plan, shard, on_micro)


@case("cost", needs=lambda ctx: ctx.hsdp, why="set_requires_all_reduce needs an HSDP (2D) mesh")
def case_cost_no_all_reduce(ctx):
    """HSDP: set_requires_all_reduce(False) for 2 of 3 micro-batches: a reduce-scatter on every
    one, the all-reduce across replicas only on the last."""
    plan = plan_for(ctx, "no all-reduce before the last of 3", micro=3)
    plan.all_reduce = lambda path, m: m == 2

    def on_micro(model, m, last):
        model.set_requires_all_reduce(last)

    return cost_case(ctx, plan, shard, on_micro)


@case("cost")
def case_cost_unshard_in_backward(ctx):
    """set_unshard_in_backward(False) on the embedding: it is gathered in forward only."""
    settings = {"tok": {"unshard_in_backward": False}}
    plan = plan_for(ctx, "set_unshard_in_backward(False) on tok", settings)

    def wrap(impl, model, mesh):
        shard(impl, model, mesh)
        model.tok.set_unshard_in_backward(False)

    return cost_case(ctx, plan, wrap)


@case("cost")
def case_cost_prefetch_lists(ctx):
    """Explicit prefetch: each block names the next in forward and the one before in backward.
    Each group is gathered once per pass, never before a hook whose list names it."""
    forward = {f"blocks.{i}": [f"blocks.{i + 1}"] for i in range(BLOCKS - 1)}
    backward = {f"blocks.{i}": [f"blocks.{i - 1}"] for i in range(1, BLOCKS)}
    plan = plan_for(ctx, "explicit prefetch lists")
    plan.forward_prefetch, plan.backward_prefetch = forward, backward

    def wrap(impl, model, mesh):
        shard(impl, model, mesh)
        blocks = list(model.blocks)
        for a, b in zip(blocks, blocks[1:]):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])

    return cost_case(ctx, plan, wrap)


@case("cost")
def case_cost_bf16(ctx):
    """param_dtype bf16, reduce_dtype fp32: all-gathers carry bf16 (half the bytes), the
    unsharded parameters are bf16, the reductions run in fp32."""
    plan = plan_for(ctx, "bf16 parameters, fp32 reductions")
    plan.param_dtype, plan.reduce_dtype = torch.bfloat16, torch.float32

    def wrap(impl, model, mesh):
        policy = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        shard(impl, model, mesh, mp_policy=policy)

    return cost_case(ctx, plan, wrap)


@case("cost")
def case_cost_bf16_reduce(ctx):
    """param_dtype bf16 and no reduce_dtype: the reductions run in bf16 too (half the bytes of
    fp32; an implementation that upcasts the gradients for the reduction pays double)."""
    plan = plan_for(ctx, "bf16 parameters and reductions")
    plan.param_dtype = torch.bfloat16

    def wrap(impl, model, mesh):
        shard(impl, model, mesh, mp_policy=impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16))

    return cost_case(ctx, plan, wrap)


@case("cost")
def case_cost_offload(ctx):
    """CPUOffloadPolicy: the same collectives and the same unsharded memory as without it."""

    def wrap(impl, model, mesh):
        shard(impl, model, mesh, offload_policy=impl.CPUOffloadPolicy(pin_memory=False))

    return cost_case(ctx, plan_for(ctx, "CPU offload"), wrap)
