"""The three collectives FSDP needs, one call per parameter, each blocking.

Every parameter of shape (rows, *rest) is padded with zero rows up to a multiple of the shard
group size S, so that it splits into S blocks of ``chunk = ceil(rows / S)`` rows each:

    all-gather      each rank's (chunk, *rest) block  ->  (S * chunk, *rest) on every rank
    reduce-scatter  every rank's (S * chunk, *rest) gradient  ->  the sum of block r on rank r
    all-reduce      HSDP only: the sum of a block over the replicas (mesh columns)

The padding rows are zero and never read by the model, so they add nothing to any sum. Each
function returns when the data is in place (one stream, nothing asynchronous: easy to step
through). With ``TWINSHARD_DEBUG=1`` each first checks that every rank of the group issues the
same one (``about``: the parameter's name, for the guard's message).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from twinshard.api import profiled
from twinshard.guard import check_collective

from . import more

# torch 2.13 renamed the single-tensor collectives; torch 2.11 has only the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def padded_rows(rows: int, shard_size: int) -> int:
    """Rows per shard block: ``ceil(rows / shard_size)``."""
    return -(-rows // shard_size)


def all_gather_rows(
    out: torch.Tensor, block: torch.Tensor, group: dist.ProcessGroup, comm=None, about=None
) -> None:
    """Fill ``out`` (S * chunk, *rest) with every rank's ``block`` (chunk, *rest), in rank order
    (with ``comm``, the user's all-gather, ``set_custom_all_gather``)."""
    check_collective("all_gather", block, group, about)  # debug mode: do the ranks agree?
    if dist.get_world_size(group) == 1:
        out.copy_(block)  # one rank: nothing to exchange
        return
    if block.element_size() == 1 and block.is_floating_point():  # float8: not in gloo, so
        out, block = out.view(torch.uint8), block.view(torch.uint8)  # (N,) bytes are sent
    with profiled("twinshard::all_gather"):
        if comm is None:
            _all_gather(out, block.contiguous(), group=group)
        else:  # second reading: more/comm_hooks.py
            more.user_all_gather(comm, out, block.contiguous(), group)


def reduce_scatter_rows(
    full: torch.Tensor, group: dist.ProcessGroup, comm=None, about=None
) -> torch.Tensor:
    """Sum ``full`` (S * chunk, *rest) over the group and return this rank's block (chunk, *rest)
    (with ``comm``, the user's reduce-scatter, ``set_custom_reduce_scatter``)."""
    check_collective("reduce_scatter", full, group, about)  # debug mode
    size = dist.get_world_size(group)
    if size == 1:
        return full  # one rank: the sum is the gradient itself
    shape = (full.shape[0] // size, *full.shape[1:])  # (chunk, *rest)
    if comm is not None:  # it allocates its output too (second reading: more/comm_hooks.py)
        return more.user_reduce_scatter(comm, full, group, shape)
    out = full.new_empty(shape)  # (chunk, *rest)
    with profiled("twinshard::reduce_scatter"):
        _reduce_scatter(out, full.contiguous(), op=dist.ReduceOp.SUM, group=group)
    return out


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup, about=None) -> None:
    """Sum ``tensor`` in place over ``group`` (HSDP replicas)."""
    check_collective("all_reduce", tensor, group, about)  # debug mode
    if dist.get_world_size(group) == 1:
        return
    with profiled("twinshard::all_reduce"):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
