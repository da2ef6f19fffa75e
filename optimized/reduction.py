"""The optimized path's gradient reduction: one reduce-scatter per parameter group.

Two free functions, each handed the group's parameters and the shared ``CommContext``:

    reduce_scatter pack + reduce-scatter (+ HSDP partial sum and all-reduce) -> ReduceScatterResult
    accumulate     wait, then on the reduce-scatter stream: the sharded gradients

They replace the reference's ``ParamGroup.reduce_param`` loop of blocking per-parameter
reductions ([Note: one flat buffer per group] in ``collectives.py``).

[Note: the mean on the wire]
The ranks' gradients are summed and the sum becomes their mean. Where the reduce dtype is fp32
or bf16 and the divisor is the number of data-parallel ranks, the collectives divide as they
reduce (``ReduceOp.AVG``), as torch's ``fully_shard`` has them do: no division runs after the
collective, on any stream, and the sharded gradients are views of the collective's output
with no second buffer. A division stays, after the sum, where torch keeps one too: fp16,
whose sum may overflow (``ParamGroup.gradient_divisors`` splits the division around it), a
factor of the user's (``set_gradient_divide_factor``) and ``set_force_sum_reduction_for_comms
(True)`` (NCCL's zero-copy and symmetric-memory reductions take SUM only); with one
data-parallel rank nothing is divided. gloo's mean is its sum divided by the group's size, so
with a power-of-two number of ranks in each mesh dimension (each division by 2^k is exact) the
gradients are the reference's to the bit; NCCL's mean may round the last bit otherwise, as
under torch.

[Note: the gradients are made on the reduce-scatter stream]
A group's reduction is finished one group later (``accumulate``, from the next group's
post-backward). The current stream waits for the reduction there, so it can free the
gradients autograd allocated on it, which the pack read; the rest (the user's all-reduce
hook, a division the collective did not do, each block added to its parameter's gradient or
made into it) is queued on the reduce-scatter stream, which allocated ``out``: new sharded
gradients are views of ``out``, as torch's are of its reduce-scatter output, and what no
gradient keeps is freed on the stream that allocated it. On the compute stream that work
delayed the next block's backward. The compute stream waits for the reduce-scatter stream
once, at the end of backward, before anything reads a gradient (``FSDPState.finish_groups``).
Post-accumulate-grad hooks (an optimizer stepped in backward) run there too, as under torch.
Where ``out`` is a block of ``packed`` (gloo's in-place path below) the blocks are copied out
of it first (the division, or a clone), so that a gradient does not keep all S blocks alive,
and ``packed`` goes after that copy.

[Note: one view a block]
Each parameter's reduced block is a view of ``out`` at its offset, made by one ``as_strided``
from the shape and contiguous strides the group computed when the parameter was sharded
(``FlatParamGroup.blocks``). Splitting ``out`` and then viewing each piece as its shape made two
tensors a block: under valgrind the split of a block's nine gradients took about 77,000
instructions and each view after it about 6,000 (``benchmarks/instructions.py``, the hooks'
setting). ``out`` is made contiguous first (it is, unless a custom reduce-scatter hands back
something else), so that the offsets and strides hold.

[Note: HSDP after the reduce-scatter]
The partial sum of earlier backwards (``set_requires_all_reduce(False)``) is added on the
reduce-scatter stream, right after the reduce-scatter: the stream that allocated those
buffers is the one that reads and drops them, so no other stream can be using them. Only then
does the all-reduce stream take over; where none follows (one replica, or the sum kept for a
later backward), the event that ``accumulate`` waits on is recorded after the addition, not after
the reduce-scatter. On the CPU that addition needs the reduce-scatter's data, so the CPU waits
for it there; without HSDP nothing waits before ``accumulate``.

[Note: one shard]
With a shard group of one rank there is no reduce-scatter: the packed gradients are the sum,
and ``out`` is ``packed`` itself. What is made of ``out`` must live in the reduce-scatter
stream's memory (the sharded gradients are views of it; HSDP keeps partial sums as views of
it, adds to them on that stream and frees them there), and ``packed`` does, being allocated
there ([Note: the gradients are packed on the reduce-scatter stream]). torch's
``fully_shard`` packs on the compute stream and copies the whole sum into the reduce-scatter
stream's memory; that copy, which the pack on the compute stream made necessary here too, is
gone.

[Note: the gradients are packed on the reduce-scatter stream]
The pack (each gradient cast into its place in the group's flat buffer, a read of 2 and a
write of 4 bytes per element in bf16 with fp32 reduction) runs on the reduce-scatter stream,
after the compute stream's event that autograd wrote the gradients, not on the compute
stream as torch's ``fully_shard`` runs it: in the plan of Llama-2-7B on 8 H100s that took
17.6 ms off the compute stream a step (1765.5 to 1747.9 ms, about 0.5 ms per group; the ideal
step's compute is 1747.7). The packed buffer is allocated on the
reduce-scatter stream and read only there (the pack, then the collective), so it goes as soon
as the reduce-scatter is queued; the next allocation of that stream comes after the
collective in the stream's order. The gradients were allocated on the compute stream and are
read on the reduce-scatter stream, so they stay until the compute stream waits for the
reduction anyway, one group later (``accumulate``). What is alive between two groups'
post-backwards is one group's gradients in the compute dtype, where torch keeps its packed
buffer in the reduce dtype: half the bytes in bf16 with fp32 reduction. On the CPU the pack
is done when ``_chunk_cat`` returns, so the gradients go right after it. Where the packed
buffer comes from a custom reduce-scatter's or the process group's memory
(``twinshard/api/comm_memory.py``), or the collective leaves ``out`` in it (gloo's in-place path),
it stays until ``accumulate``, as before.

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

import torch
import torch.distributed as dist

from twinshard.api import without_grad
from twinshard.guard import unused_grads
from twinshard.reference.sharded_param import ShardedParam

from .comm import CommContext, Pending

# torch 2.13 renamed the single-tensor collective; torch 2.11 has only the old name.
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class ReduceScatterResult:
    pending: Pending  # the reduce-scatter, or the HSDP all-reduce after it
    packed: torch.Tensor | None  # (S * per-rank numel,) the gradients, rank-major; None: gone
    out: torch.Tensor | None  # (per-rank numel,) this rank's reduced block of every gradient
    grads: list | None  # the unreduced gradients the pack reads, until it is waited for
    params: list  # the ShardedParams in ``out``, in order
    shapes: list  # per param: its block's shape, a tuple (chunk, *rest)
    sizes: list  # per param: its block's numel, so ``out`` splits into the blocks
    strides: list  # per param: its block's strides, contiguous
    used: list  # per param: whether this rank had a gradient (else it sent zeros)
    declared: list  # per param: used here, or unused by the user's word (keep_unused)
    divide_after: float | None  # what the sum is divided by, if the collective did not
    kept_partial: bool  # HSDP without all-reduce: the sums wait in the params; add nothing
    out_in_packed: bool  # ``out`` is a block of ``packed`` (see [Note: reduce-scatter on gloo])


@without_grad
def reduce_scatter(
    params: list,
    dtype: torch.dtype,
    info,
    all_reduce: bool,
    ops: tuple,
    comm: CommContext,
    blocks: dict,
    custom=None,
    keep_unused: bool = False,
    group: dist.ProcessGroup | None = None,
    memory=None,
) -> ReduceScatterResult | None:
    """Pack the waiting gradients of ``params`` (all of reduce dtype ``dtype``; zeros for a
    trainable parameter this rank did not use) into one buffer and reduce-scatter it, with the
    user's ``custom`` reduce-scatter if one was set; for HSDP add the partial sums and
    all-reduce across replicas. ``ops``: what the gradients are divided by before the
    collectives (None: nothing), the collectives' reduce op, and what the result is divided
    by after them (None: nothing; ``FlatParamGroup.reduce_ops``, see [Note: the mean on the
    wire]). ``group``: another process group over the shard ranks for the reduce-scatter
    (``set_separate_reduce_scatter_group``). ``memory``: where the buffers come from without
    a custom reduce-scatter (``twinshard/api/comm_memory.py``). ``blocks``: each parameter's block as (numel,
    shape tuple, strides), computed once by the group (``view(*shape)`` takes 0.9 us,
    ``view(torch.Size)`` 2.2 us: the group's blocks are viewed at every step)."""
    group = group or info.shard_group
    divide_before, op, divide_after = ops
    used, grads = ShardedParam.reduce_scatter_inputs(params, dtype)  # None: frozen, no part
    taken = [i for i, g in enumerate(grads) if g is not None]
    if not taken:
        return None
    params, used = [params[i] for i in taken], [used[i] for i in taken]
    grads = [grads[i] for i in taken]
    sizes, shapes = [blocks[p][0] for p in params], [blocks[p][1] for p in params]
    strides = [blocks[p][2] for p in params]
    S = info.shard_size
    memory = custom or memory
    in_place = custom is None and info.replicate_group is None and comm.runs_on_gloo(group)
    # see [Note: the gradients are cast as they are packed]
    if len({g.dtype for g in grads}) > 1:  # zeros of an unused parameter beside the others
        grads = [g.to(dtype) for g in grads]
    # see [Note: the gradients are packed on the reduce-scatter stream]: after autograd wrote them
    comm.reduce_scatter_stream.wait_stream(comm.current_stream())
    with comm.on(comm.reduce_scatter_stream):
        size = (S * sum(sizes),)
        packed = memory.allocate(size, dtype=dtype, device=grads[0].device) if memory else None
        packed = (
            grads[0].new_empty(size, dtype=dtype) if packed is None else packed
        )  # (S * per-rank,)
        # rank-major: block r of every gradient, for r = 0 .. S-1 (one op instead of a view each)
        torch._chunk_cat(grads, dim=0, num_chunks=S, out=packed.view(S, -1))
        if comm.async_op:  # on the CPU the pack is done: the gradients go now
            comm.streams.release(grads, "release of the unreduced gradients")
            grads = None
        if divide_before is not None:  # fp16: see ``ParamGroup.gradient_divisors``
            packed.div_(divide_before)
        if S == 1:  # one rank in the shard group: the sum is the input itself
            out, packed = packed, None  # see [Note: one shard]
            pending = comm.done_on(comm.reduce_scatter_stream)
        elif in_place:  # see [Note: reduce-scatter on gloo]
            out = packed.view(S, -1)[info.shard_rank]  # (per-rank numel,) this rank's block
            pending = comm.issue(
                dist.all_reduce,
                packed,
                group=group,
                op=op,
                stream=comm.reduce_scatter_stream,
                about=params,
            )
        else:
            size = (packed.numel() // S,)  # (per-rank numel,)
            out = memory.allocate(size, dtype=dtype, device=packed.device) if memory else None
            out = packed.new_empty(size) if out is None else out
            pending = comm.issue(
                custom or reduce_scatter_into,
                out,
                packed,
                group=group,
                op=op,
                stream=comm.reduce_scatter_stream,
                about=params,
            )
            if memory is None:  # its stream's own memory, read only there: it goes now
                comm.streams.release((packed,), "release of the reduce_scatter input")
                packed = None
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
            op=op,
            stream=comm.all_reduce_stream,
            about=params,
        )
    declared = [u or keep_unused for u in used]
    in_packed = in_place and S > 1
    return ReduceScatterResult(
        pending=pending,
        packed=packed,
        out=out,
        grads=grads,
        params=params,
        shapes=shapes,
        sizes=sizes,
        strides=strides,
        used=used,
        declared=declared,
        divide_after=divide_after,
        kept_partial=kept,
        out_in_packed=in_packed,
    )


@without_grad
def accumulate(result: ReduceScatterResult, comm: CommContext, hook=None) -> None:
    """Wait for a reduction and, on the reduce-scatter stream, run the user's all-reduce
    ``hook`` on it (once for the group's flat buffer), divide it if the collectives did not,
    and add each parameter's block to its sharded gradient (replaces the end of
    ``ParamGroup.reduce_param``); see [Note: the gradients are made on the reduce-scatter
    stream]."""
    comm.wait(result.pending)  # the pack has read the gradients: the current stream
    packed, out, grads = result.packed, result.out, result.grads
    result.packed = result.out = result.grads = None
    if grads is not None:  # allocated by autograd on the current stream, which has waited
        comm.streams.release(grads, "release of the unreduced gradients")
        del grads
    if packed is not None and (result.kept_partial or not result.out_in_packed):
        # the reduce-scatter stream allocated it and was its last reader (kept partial sums
        # are views of ``out``)
        comm.streams.release((packed,), "release of the reduce_scatter input")
        del packed
    if result.kept_partial:
        return
    stream = comm.reduce_scatter_stream
    comm.wait(result.pending, stream)  # HSDP: the all-reduce's stream
    with comm.on(stream):
        if hook is not None:
            hook(out)  # in place, before any division, as torch's FSDP2 calls it
        if result.divide_after is not None:
            d = result.divide_after
            out = out / d if result.out_in_packed else out.div_(d)
        elif result.out_in_packed:
            out = out.clone()  # (per-rank numel,) so that the gradients do not keep ``packed``
        out = out.contiguous()  # (per-rank numel,): the blocks below are read at its strides
        if result.out_in_packed:  # after the copy out of it, on the stream that allocated it
            comm.streams.release((packed,), "release of the reduce_scatter input, block copied out")
            del packed
        blocks, start = [], out.storage_offset()  # each parameter's (chunk, *rest), a view
        for size, shape, stride in zip(result.sizes, result.shapes, result.strides):
            blocks.append(out.as_strided(shape, stride, start))  # see [Note: one view a block]
            start += size
        for p, declared in zip(result.params, result.declared):  # before any is added
            unused_grads.note_reduced(p, declared)  # every rank keeps every sum: see the guard
        ShardedParam.accumulate_grads(result.params, blocks)
