"""The optimized path's collectives: one all-gather and one reduce-scatter per parameter group.

Four free functions, each handed the group's parameters and the shared ``CommContext``; the
two that issue work return a small record of what is in flight:

    all_gather     copy-in + all-gather       -> AllGatherResult
    copy_out       wait, split into the unsharded parameters
    reduce_scatter pack + reduce-scatter (+ HSDP partial sum and all-reduce) -> ReduceScatterResult
    accumulate     wait, divide, add to the sharded gradients

They move parameters between states only through ``ShardedParam``'s public methods, the
same ones the reference's per-parameter loop calls; only the batching and the streams differ.

[Note: one flat buffer per group]
The reference all-gathers each parameter separately: for a block of nine weights that is nine
collectives, each paying the full latency of a round trip. Here the group's blocks are copied
into one flat buffer (rank-major: every rank contributes its blocks of all parameters, in the
same order) and gathered at once; viewing the result as (ranks, per-rank numel) and splitting
along dim 1 hands each parameter its (ranks, chunk * rest) slice, which is exactly its padded
unsharded tensor viewed as (ranks, chunk * rest). Gradients go the other way. Every element
takes the same values through the same sums as in the reference; only how many messages carry
them changes, so in fp32 at world size <= 2 the results are bitwise equal.

[Note: gathered in place]
The copy-in writes this rank's blocks straight into its slot of the all-gather's output, and
that slot is the collective's input: no separate send buffer (1/S of the group) is allocated.
The output is therefore allocated on the copy-in stream, before the copy-in.

[Note: all-gather on gloo]
gloo's all-gather costs several times the CPU of the exchange it amounts to. Measured on the
2-core CPU machine with 2 ranks and 5M fp32 elements per rank, ``all_gather_into_tensor`` took
30-33 ms of CPU per call and an ``all_to_all_single`` that sends this rank's slot to the peer
and receives the peer's slot 6-8 ms (1M elements: 6 ms against 1.2 ms). With a shard group of
two ranks the all-gather is exactly that exchange, received straight into the peer's slot of
the output, so on gloo such a group issues it instead: the same bytes on the wire, the same
result bit for bit, no buffer added. Traces and recorded schedules count an exchange in place
as the all-gather it is (``twinshard.c10d.gathered_in_place``). A larger group keeps
the all-gather: ``all_to_all_single`` takes one input split per peer, so it would need this
rank's slot once per peer, a copy of the whole group.

[Note: mixed dtypes in one group]
A group may hold parameters of several dtypes (a frozen float8 weight beside float32 ones), and
a parameter with the all-gather extension may gather tensors of several dtypes (float8 data
and a float32 scale; ``reference/more/extension.py``). A flat buffer has one dtype, and float8 has
no type promotion, so such a group is gathered as bytes: each tensor is viewed as uint8,
gathered, and each output is viewed as uint8 for the copy-out. No value is converted, so the result is the same as gathering each dtype on
its own. Reductions need arithmetic, so those are grouped by dtype instead (``flat_group.py``).

[Note: HSDP after the reduce-scatter]
The partial sum of earlier backwards (``set_requires_all_reduce(False)``) is added on the
reduce-scatter stream, right after the reduce-scatter: the stream that allocated those
buffers is the one that reads and drops them, so no other stream can be using them. Only then
does the all-reduce stream take over; where none follows (one replica, or the sum kept for a
later backward), the event that ``accumulate`` waits on is recorded after the addition, not after
the reduce-scatter. On the CPU that addition needs the reduce-scatter's data, so the CPU waits
for it there; without HSDP nothing waits before ``accumulate``.

[Note: HSDP with one shard]
With a shard group of one rank there is no reduce-scatter: the packed gradients are the sum. Plain
FSDP then reads them where they are. HSDP keeps partial sums as views of the reduced buffer, adds
to them on the reduce-scatter stream and frees them there, so that buffer must come from the
reduce-scatter stream's memory: it is copied there once (mesh (R, 1), that is DDP, one group's
gradients per reduction). Kept as views of ``packed``, allocated on the compute stream, they
would be freed to the compute stream's pool while the reduce-scatter stream may still add to them.

[Note: the gradients go at the pack]
The group's unsharded gradients are packed on the stream that autograd wrote them on (the
current one), and dropped right there: nothing else reads them, so no other stream has to
finish first, and a group's gradients never outlive its own post-backward. Only the packed
buffer crosses to the reduce-scatter stream; it goes once the reduction has been waited for
and added, like every buffer that crosses streams.

[Note: the gradients are cast as they are packed]
Autograd writes a group's gradients in the compute dtype (bf16 with mixed precision), and the
reduction runs in the reduce dtype (fp32). The group's buffer is allocated in the reduce dtype
and ``_chunk_cat`` writes each gradient into its place in it, casting as it copies: one pass
that reads 2 bytes and writes 4 per element, as torch's ``fully_shard`` packs. Casting each
gradient on its own first (in ``take_grad``) and then packing read and wrote every element
twice (2 + 4 + 4 + 4 bytes). Several backwards without a reduction
(``set_requires_gradient_sync(False)``) add each bf16 gradient to the fp32 sum as it is,
which widens it in the same pass (``ShardedParam.take_grad``).

[Note: reduce-scatter on gloo]
gloo has no reduce-scatter of its own: ``reduce_scatter_tensor`` clones the whole input on the
calling thread, all-reduces the clone and copies this rank's block out of it at ``wait()``.
The packed gradients are ours to overwrite, so on gloo the group all-reduces them in place and
keeps a view of its block: the same sums over the same bytes on the wire, minus a copy of the
group's gradients and a 1/S copy on the CPU that runs the model (at world size 2 with the
``small`` preset, 13 ms of the main thread's time per step), and minus the clone's memory. A
custom reduce-scatter, and HSDP (whose partial sums would keep the whole buffer alive), take
the reduce-scatter as before. Traces and recorded schedules show an all-reduce there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from twinshard.api import without_grad

from .comm import CommContext, Pending

# torch 2.13 renamed the single-tensor collectives; torch 2.11 has only the old names.
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class AllGatherResult(NamedTuple):
    pending: Pending
    send: torch.Tensor  # (per-rank numel,) this rank's blocks, flat: its slot of ``recv``
    recv: torch.Tensor  # (ranks * per-rank numel,) every rank's blocks, rank-major
    ranks: int
    params: list  # the ShardedParams in ``send``, in order
    dtypes: list  # their all-gather (compute) dtypes
    as_bytes: bool  # mixed dtypes, gathered as uint8; see [Note: mixed dtypes in one group]


@dataclass
class ReduceScatterResult:
    pending: Pending  # the reduce-scatter, or the HSDP all-reduce after it
    packed: torch.Tensor | None  # (S * per-rank numel,) the gradients, rank-major
    out: torch.Tensor | None  # (per-rank numel,) this rank's reduced block of every gradient
    params: list  # the ShardedParams in ``out``, in order
    shapes: list  # per param: its block's shape, a tuple (chunk, *rest)
    sizes: list  # per param: its block's numel, so ``out`` splits into the blocks
    used: list  # per param: whether this rank had a gradient (else it sent zeros)
    add: list  # per param: whether to add its block to the sharded gradient
    divide_after: float  # the sum becomes the mean (``ParamGroup.gradient_divisors``)
    kept_partial: bool  # HSDP without all-reduce: the sums wait in the params; add nothing

    def release(self, comm: CommContext) -> None:
        """Let the buffers go once their last use (on the current stream) is queued, and
        forget them here, so that releasing them frees their memory."""
        if self.kept_partial:  # ``out`` lives on in the partial sums; only ``packed`` goes
            buffers, streams = (self.packed,), ()
        else:  # ``out`` was allocated on the reduce-scatter stream
            buffers, streams = (self.packed, self.out), (comm.reduce_scatter_stream,)
        self.packed = self.out = None
        comm.free_after_use("release of the reduce_scatter buffers", buffers, *streams)


@without_grad
def all_gather(
    params: list,
    dtypes: list,
    mesh,
    comm: CommContext,
    custom=None,
    kept=None,
    after_current: bool = False,
) -> AllGatherResult:
    """Copy this rank's blocks of ``params`` into one flat buffer and all-gather it over the
    shard group of ``mesh`` (a ``MeshInfo``), with the user's ``custom`` all-gather if one was
    set (it allocates the output and is called once for the whole group). ``kept``: the
    group's padded blocks, flat, kept ready (``FlatParamGroup.kept_shards``), concatenated as
    they are, and their total numel. ``after_current``: shards were written on the current
    stream since the optimizer step (``CommContext.before_all_gather``). Replaces the
    reference's ``ParamGroup.unshard_param`` loop, one blocking all-gather per parameter; see
    [Note: one flat buffer per group]."""
    comm.before_all_gather(after_current)
    kept = None if is_float8(dtypes[0]) else kept  # float8 blocks go as bytes
    ranks = mesh.shard_size
    with comm.on(comm.copy_in_stream):
        if kept is None:  # a parameter with the all-gather extension may bring several tensors
            pieces = [x.ravel() for p, d in zip(params, dtypes) for x in p.all_gather_inputs(d)]
            kinds = [x.dtype for x in pieces]
            as_bytes = kinds.count(kinds[0]) != len(kinds) or is_float8(kinds[0])
            pieces = [x.view(torch.uint8) for x in pieces] if as_bytes else pieces
            numel, dtype, device = sum(x.numel() for x in pieces), pieces[0].dtype, pieces[0].device
        else:  # see [Note: the group keeps its blocks padded] in flat_group.py
            pieces, numel = kept
            dtype, device, as_bytes = dtypes[0], pieces[0].device, False
        if ranks == 1:  # one rank: nothing to exchange, the copy-out reads the input itself
            send = torch.cat(pieces).to(dtype=dtype)  # a new tensor: the kept blocks stay
            pending = comm.done_on(comm.copy_in_stream)
            return AllGatherResult(pending, send, send, 1, params, dtypes, as_bytes)
        # see [Note: gathered in place]
        size = (ranks * numel,)
        recv = custom.allocate(size, dtype=dtype, device=device) if custom else None
        recv = torch.empty(size, dtype=dtype, device=device) if recv is None else recv
        send = recv.narrow(0, mesh.shard_rank * numel, numel)  # this rank's slot
        torch.cat(pieces, out=send)  # kept blocks are cast to the compute dtype on the way
    comm.all_gather_stream.wait_stream(comm.copy_in_stream)
    with comm.on(comm.all_gather_stream):
        if ranks == 2 and custom is None and comm.runs_on_gloo(mesh.shard_group):
            # see [Note: all-gather on gloo]
            peer = 1 - mesh.shard_rank
            splits = [0, 0]
            splits[peer] = numel  # send this rank's slot to the peer, take the peer's
            pending = comm.issue(
                dist.all_to_all_single,
                recv.view(ranks, -1)[peer],  # (per-rank numel,) the peer's slot
                send,
                output_split_sizes=splits,
                input_split_sizes=splits,
                group=mesh.shard_group,
                stream=comm.all_gather_stream,
                about=params,
                stands_for="all_gather",
            )
        else:
            pending = comm.issue(
                custom or all_gather_into,
                recv,
                send,
                group=mesh.shard_group,
                stream=comm.all_gather_stream,
                about=params,
            )
    return AllGatherResult(pending, send, recv, ranks, params, dtypes, as_bytes)


@without_grad
def copy_out(result: AllGatherResult, comm: CommContext, views: dict) -> None:
    """Wait for the all-gather and copy every parameter out of it with one fused split-copy
    (replaces the reference's all-gather straight into each parameter's own buffer).
    ``views``: the group's cache for ``gathered_views``."""
    comm.wait(result.pending)
    outs, sizes = gathered_views(result, views)
    recv = result.recv.view(result.ranks, -1)  # (ranks, per-rank numel)
    torch.split_with_sizes_copy(recv, sizes, dim=1, out=outs)
    for p in result.params:
        p.finish_unshard()
    comm.free_after_use(
        "release of the all_gather buffers",
        (result.send, result.recv),
        comm.copy_in_stream,
        comm.all_gather_stream,
    )


def gathered_views(result: AllGatherResult, cache: dict) -> tuple[list, list]:
    """Each parameter's all-gather outputs (``all_gather_outputs``, memory allocated again)
    viewed as (ranks, numel per rank), as bytes for a group of mixed dtypes, and the numel per
    rank of each view (the split sizes of the copy-out).

    [Note: the copy-out views are kept]
    A parameter's all-gather output is one tensor for the whole run: resharding frees its
    memory and the next unshard allocates it again, in the same storage. A view of it therefore
    stays a view of it, so the views made by one copy-out serve every later one; making nine
    views costs about as much as the split-copy that fills them. They are made again when the
    outputs are not the same tensors (another set of parameters) or the shape differs."""
    outs = [o for p, d in zip(result.params, result.dtypes) for o in p.all_gather_outputs(d)]
    key = (result.ranks, result.as_bytes)
    kept = cache.get(key)
    if kept is None or not same_tensors(kept[0], outs):
        views = [o.view(result.ranks, -1) for o in outs]  # (ranks, numel per rank)
        if result.as_bytes:
            views = [v.view(torch.uint8) for v in views]  # (ranks, bytes per rank)
        kept = cache[key] = (outs, views, [v.shape[1] for v in views])
    return kept[1], kept[2]


def is_float8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is a float8: gloo and type promotion know no such dtype."""
    return dtype.itemsize == 1 and dtype.is_floating_point


def same_tensors(a: list, b: list) -> bool:
    """Whether ``a`` and ``b`` hold the very same tensor objects, in the same order."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x is not y:
            return False
    return True


@without_grad
def reduce_scatter(
    params: list,
    dtype: torch.dtype,
    info,
    all_reduce: bool,
    divisors: tuple,
    comm: CommContext,
    blocks: dict,
    custom=None,
    keep_unused: bool = False,
    group: dist.ProcessGroup | None = None,
) -> ReduceScatterResult | None:
    """Pack the waiting gradients of ``params`` (all of reduce dtype ``dtype``; zeros for a
    trainable parameter this rank did not use) into one buffer and reduce-scatter it, with the
    user's ``custom`` reduce-scatter if one was set; for HSDP add the partial sums and
    all-reduce across replicas. Replaces the reference's ``ParamGroup.reduce_param`` loop of
    blocking per-parameter reductions. ``divisors``: what the gradients are divided by
    before the sum (None: nothing) and after it (``ParamGroup.gradient_divisors``; the second
    is applied by ``accumulate``). ``group``: another process group over the shard
    ranks for the reduce-scatter (``set_separate_reduce_scatter_group``). ``blocks``: each
    parameter's block as (numel, shape tuple), computed once by the group (``view(*shape)``
    takes 0.9 us, ``view(torch.Size)`` 2.2 us: the group's blocks are viewed at every step)."""
    group = group or info.shard_group
    used = [p.has_grad_to_reduce for p in params]
    grads = [p.reduce_scatter_input(dtype) for p in params]  # None: frozen, takes no part
    taken = [i for i, g in enumerate(grads) if g is not None]
    if not taken:
        return None
    params, used = [params[i] for i in taken], [used[i] for i in taken]
    grads = [grads[i] for i in taken]
    sizes, shapes = [blocks[p][0] for p in params], [blocks[p][1] for p in params]
    S = info.shard_size
    # see [Note: the gradients go at the pack] and [Note: the gradients are cast as they are packed]
    if len({g.dtype for g in grads}) > 1:  # zeros of an unused parameter beside the others
        grads = [g.to(dtype) for g in grads]
    packed = grads[0].new_empty((S * sum(sizes),), dtype=dtype)  # (S * per-rank,)
    # rank-major: block r of every gradient, for r = 0 .. S-1 (one op instead of a view each)
    torch._chunk_cat(grads, dim=0, num_chunks=S, out=packed.view(S, -1))
    comm.streams.release(grads, "release of the unreduced gradients")
    del grads
    comm.reduce_scatter_stream.wait_stream(comm.current_stream())
    with comm.on(comm.reduce_scatter_stream):
        if divisors[0] is not None:  # fp16: see ``ParamGroup.gradient_divisors``
            packed.div_(divisors[0])
        if S == 1:  # one rank in the shard group: the sum is the input itself
            # see [Note: HSDP with one shard]
            out = packed.clone() if info.replicate_group is not None else packed
            pending = comm.done_on(comm.reduce_scatter_stream)
        elif custom is None and info.replicate_group is None and comm.runs_on_gloo(group):
            # see [Note: reduce-scatter on gloo]
            out = packed.view(S, -1)[info.shard_rank]  # (per-rank numel,) this rank's block
            pending = comm.issue(
                dist.all_reduce,
                packed,
                group=group,
                op=dist.ReduceOp.SUM,
                stream=comm.reduce_scatter_stream,
                about=params,
            )
        else:
            size = (packed.numel() // S,)  # (per-rank numel,)
            out = custom.allocate(size, dtype=dtype, device=packed.device) if custom else None
            out = packed.new_empty(size) if out is None else out
            pending = comm.issue(
                custom or reduce_scatter_into,
                out,
                packed,
                group=group,
                op=dist.ReduceOp.SUM,
                stream=comm.reduce_scatter_stream,
                about=params,
            )
        kept = False
        if info.replicate_group is not None:  # see [Note: HSDP after the reduce-scatter]
            comm.wait(pending, comm.reduce_scatter_stream)
            pieces = torch.split_with_sizes(out, sizes)
            for p, piece, shape in zip(params, pieces, shapes):
                p.combine_partial_sum(piece.view(*shape), all_reduce)
            kept = not all_reduce
            # what waits for this reduction must also wait for the sums just added
            pending = comm.done_on(comm.reduce_scatter_stream)
    if info.replicate_group is not None and all_reduce and info.replicate_size > 1:
        comm.all_reduce_stream.wait_stream(comm.reduce_scatter_stream)
        pending = comm.issue(
            dist.all_reduce,
            out,
            group=info.replicate_group,
            stream=comm.all_reduce_stream,
            about=params,
        )
    add = [u or keep_unused for u in used]
    return ReduceScatterResult(
        pending, packed, out, params, shapes, sizes, used, add, divisors[1], kept
    )


@without_grad
def accumulate(result: ReduceScatterResult, comm: CommContext, hook=None) -> None:
    """Wait for a reduction, run the user's all-reduce ``hook`` on it (once for the group's
    flat buffer), and add each parameter's block to its sharded gradient (replaces the end of
    ``ParamGroup.reduce_param``: one division for the whole group)."""
    comm.wait(result.pending)
    if result.kept_partial:
        result.release(comm)
        return
    if hook is not None:
        hook(result.out)  # in place, before the division, as torch's FSDP2 calls it
    reduced = result.out / result.divide_after  # (per-rank numel,) the mean over ranks
    result.release(comm)  # before the sharded gradients are allocated
    blocks = torch.split_with_sizes(reduced, result.sizes)
    for p, block, shape, add in zip(result.params, blocks, result.shapes, result.add):
        if add:
            p.accumulate_grad(block.view(*shape))
