"""Collective-trace cases: one training step recorded collective by collective.

Every rank must issue the same sequence; all-gathers must run in the parameter dtype and
reductions in the reduce dtype; and the amounts must follow the schedule, per group or per
parameter (see ``twinshard.conformance.trace``). No collective that the mesh does not need: a
shard group of one rank has nothing to all-gather or reduce-scatter (1, 2x1, 3x1), and a single
replica nothing to all-reduce (1D meshes, 1x2, 1x3); an HSDP mesh with two or more replicas
all-reduces each group's gradients across them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from twinshard.measure.schedule.groups import find_groups

from .. import models as M
from .. import trace as T
from ..compare import Checker
from .core import case


def _trace_case(
    ctx,
    unshards_block: int,
    unshards_root: int,
    param=torch.float32,
    reduce=torch.float32,
    **kwargs,
) -> Checker:
    """Trace one forward+backward of the per-block MLP and check it against the schedule."""
    checker = Checker("fp32")
    model = M.MLPStack()
    if param != torch.float32 or reduce != torch.float32:
        kwargs["mp_policy"] = ctx.impl.MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)
    M.shard_blocks(ctx.impl, model, ctx.mesh, **kwargs)
    groups = _groups(checker, model, unshards_block, unshards_root)
    x, y = M.mlp_data()(0)
    per = x.shape[0] // ctx.world
    x, y = (t[ctx.rank * per : (ctx.rank + 1) * per].to(ctx.device) for t in (x, y))
    with T.CollectiveTrace() as recorded:
        M.mse(model, (x, y)).backward()
    calls = recorded.calls
    if not ctx.hsdp and dist.get_backend() == "gloo":
        calls = T.gloo_reduce_scatters(calls)
    checker.count += 1
    if (mismatch := T.compare_ranks(calls)) is not None:
        checker.fail(f"collective traces differ across ranks: {mismatch}")
    S = ctx.shard_size
    size = lambda ps: sum(T.padded_numel(p, S) for p in ps)  # noqa: E731
    needed = {
        "all_gather": (
            [n for _, n in groups],
            sum(n * size(ps) for ps, n in groups),
            param,
            [n * len(ps) for ps, n in groups],
        ),
        "reduce_scatter": (
            [1 for _ in groups],
            sum(size(ps) for ps, _ in groups),
            reduce,
            [len(ps) for ps, _ in groups],
        ),
        "all_reduce": (
            [1 for _ in groups],
            sum(size(ps) // S for ps, _ in groups),
            reduce,
            [len(ps) for ps, _ in groups],
        ),
    }
    replicas = ctx.mesh_shape[0] if ctx.hsdp else 1
    unneeded = {  # op -> why the mesh needs none of it
        "all_gather": "a shard group of one rank" if S == 1 else None,
        "reduce_scatter": "a shard group of one rank" if S == 1 else None,
        "all_reduce": "a single replica" if replicas == 1 else None,
    }
    for op, (per_group, numel, dtype, per_param) in needed.items():
        count, total, dtypes = T.totals(calls, op)
        checker.count += 1
        if unneeded[op] is not None:
            if count:
                checker.fail(
                    f"{op}: {count} collectives ({total} elements) where {unneeded[op]} needs none"
                )
            continue
        if count not in (sum(per_group), sum(per_param)):
            checker.fail(
                f"{op}: {count} collectives, expected {sum(per_group)} (one per group "
                f"and unshard) or {sum(per_param)} (one per parameter)"
            )
        if total != numel:
            checker.fail(f"{op}: {total} elements in all, the schedule implies {numel}")
        if dtypes != {dtype}:
            checker.fail(f"{op}: dtypes {sorted(map(str, dtypes))}, the policy says {dtype}")
    return checker


def _groups(checker: Checker, model, unshards_block: int, unshards_root: int) -> list[tuple]:
    """The implementation's parameter groups, each with its parameters and how many times a
    step gathers it: a block's as a block, the root's as the root. One ``fully_shard`` call is
    one group, or several where the implementation cuts it in pieces along its modules
    (``twinshard.optimized.in_pieces``); a group holding parameters of two calls fails."""
    paths = {id(m): path for path, m in model.named_modules()}
    groups = []
    for group in find_groups(model):
        names = [f"{paths[id(owner)]}.{attr}".lstrip(".") for _, owner, attr in group.params]
        calls = {".".join(n.split(".")[:2]) if n.startswith("blocks.") else "" for n in names}
        if len(calls) > 1:
            checker.fail(f"group {group.path or '(root)'} holds parameters of {sorted(calls)}")
        n = unshards_block if calls != {""} else unshards_root
        groups.append(([getattr(owner, attr) for _, owner, attr in group.params], n))
    return groups


@case("trace")
def case_trace_default(ctx):
    """Default schedule: blocks gathered in forward and backward, the root once; one
    reduce-scatter per group; the same sequence on every rank."""
    return _trace_case(ctx, 2, 1)


@case("trace")
def case_trace_reshard_false(ctx):
    """reshard_after_forward=False: every group is gathered once per step."""
    return _trace_case(ctx, 1, 1, reshard_after_forward=False)


@case(
    "trace",
    needs=lambda ctx: ctx.shard_size % 2 == 0 and ctx.shard_size > 2,
    why="needs a shard group of 4 or more (even), where 2 differs from True",
)
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
