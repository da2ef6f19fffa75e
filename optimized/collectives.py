"""The optimized path's all-gather: one collective per parameter group.

Two free functions, each handed the group's parameters and the shared ``CommContext``:

    all_gather     copy-in + all-gather + copy-out -> AllGatherResult (what is in flight)
    copy_out       wait for them, and the parameters are unsharded

Gradients go the other way in ``reduction.py``. Both move parameters between states only
through ``ShardedParam``'s public methods, the same ones the reference's per-parameter loop
calls; only the batching and the streams differ.

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
as the all-gather it is (``twinshard.dispatch.c10d.gathered_in_place``). A larger group keeps
the all-gather: ``all_to_all_single`` takes one input split per peer, so it would need this
rank's slot once per peer, a copy of the whole group.

[Note: the copy-out on a stream of its own]
The copy of each parameter out of the gathered buffer is queued on a stream of its own, the
copy-out stream, right behind the all-gather (``CommContext.after``: that stream waits for the
all-gather's event), into the parameters' memory allocated when the all-gather is issued; the
compute stream only waits for that, before the group computes. torch's ``fully_shard`` copies
out on the compute stream, when the group is about to compute: a read and a write of the whole
group in the compute dtype, in each forward and each backward. In the plan of Llama-2-7B on 8
H100s that was 0.35 ms of the compute stream per block and pass; here it runs beside the
previous group's compute. Queued on the all-gather stream itself, the copy held that stream,
so the next all-gather waited for it: where the link is the bottleneck (Llama 2 70B on 64
A100s) the link idled 2.1 ms between two all-gathers of forward. On the CPU, where gloo's work
handle says when the gather is done, the copy runs at the wait, as before. The parameters'
memory comes from the copy-out stream's pool, so that stream writes memory of its own; the
compute stream frees it at a reshard, after its last use there, and the copy-out stream
writes it again only behind a later all-gather, which is ordered after everything the compute
stream queued before it (``CommContext.before_all_gather``; with ``set_post_optim_event``,
after that event, and every reshard of a step comes before its optimizer step). The gathered
buffer goes after the copy out of it: see [Note: in forward, a gathered buffer goes one
all-gather later] in ``comm.py``.

[Note: mixed dtypes in one group]
A group may hold parameters of several dtypes (a frozen float8 weight beside float32 ones), and
a parameter with the all-gather extension may gather tensors of several dtypes (float8 data
and a float32 scale; ``reference/more/extension.py``). A flat buffer has one dtype, and float8 has
no type promotion, so such a group is gathered as bytes: each tensor is viewed as uint8,
gathered, and each output is viewed as uint8 for the copy-out. No value is converted, so the result is the same as gathering each dtype on
its own. Reductions need arithmetic, so those are grouped by dtype instead (``flat_group.py``).

"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from twinshard.api import without_grad
from twinshard.reference.sharded_param import ShardedParam

from .comm import CommContext, Pending

# torch 2.13 renamed the single-tensor collective; torch 2.11 has only the old name.
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class AllGatherResult(NamedTuple):
    pending: Pending
    send: torch.Tensor | None  # (per-rank numel,) this rank's blocks, flat: its slot of ``recv``
    recv: torch.Tensor | None  # (ranks * per-rank numel,) every rank's blocks, rank-major
    ranks: int
    params: list  # the ShardedParams in ``send``, in order
    dtypes: list  # their all-gather (compute) dtypes
    as_bytes: bool  # mixed dtypes, gathered as uint8; see [Note: mixed dtypes in one group]
    views: dict | None = None  # the group's view cache, where the copy-out is left to the wait
    own: bool = False  # the parameter's memory is the copy-in stream's ([Note: one parameter...])
    then: AllGatherResult | None = None  # the group's next mesh's ([optimized/meshes.py])


@without_grad
def all_gather(
    params: list,
    dtypes: list,
    mesh,
    comm: CommContext,
    custom=None,
    kept=None,
    after_current: bool = False,
    memory=None,
    views: dict | None = None,
) -> AllGatherResult:
    """Copy this rank's blocks of ``params`` into one flat buffer and all-gather it over the
    shard group of ``mesh`` (a ``MeshInfo``), with the user's ``custom`` all-gather if one was
    set (it allocates the output and is called once for the whole group). ``kept``: the
    group's padded blocks, flat, kept ready (``KeptBlocks.kept_shards``, ``kept_blocks.py``), concatenated as
    they are, and their total numel. ``after_current``: shards were written on the current
    stream since the optimizer step (``CommContext.before_all_gather``). ``memory``: where
    the output comes from without a custom all-gather (``twinshard/api/comm_memory.py``). ``views``: the
    group's cache for ``gathered_views``. The copy-out follows the all-gather on its stream
    ([Note: the copy-out on a stream of its own]). Replaces the reference's
    ``ParamGroup.unshard_param`` loop, one blocking all-gather per parameter; see [Note: one
    flat buffer per group]."""
    copy_out_at_wait = comm.before_all_gather(after_current)
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
            comm.copied_in = pending.event
            result = AllGatherResult(
                pending=pending,
                send=send,
                recv=send,
                ranks=1,
                params=params,
                dtypes=dtypes,
                as_bytes=as_bytes,
            )
            return queue_copy_out(result, comm, views, copy_out_at_wait)
        # see [Note: gathered in place]
        size = (ranks * numel,)
        memory = custom or memory
        recv = memory.allocate(size, dtype=dtype, device=device) if memory else None
        own = None  # see [Note: one parameter, no copy-out]
        tried_own = recv is None and not copy_out_at_wait and not as_bytes
        tried_own = tried_own and len(params) == len(pieces) == 1
        if tried_own:
            own = recv = own_output(params[0], dtypes[0], size, dtype)
        recv = torch.empty(size, dtype=dtype, device=device) if recv is None else recv
        send = recv.narrow(0, mesh.shard_rank * numel, numel)  # this rank's slot
        torch.cat(pieces, out=send)  # kept blocks are cast to the compute dtype on the way
        comm.copied_in = comm.copy_in_stream.record_event()
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
    if own is not None:  # the parameter's own memory: nothing to copy out, nothing to free
        return AllGatherResult(
            pending=pending,
            send=None,
            recv=None,
            ranks=ranks,
            params=params,
            dtypes=dtypes,
            as_bytes=as_bytes,
            own=True,
        )
    # a parameter whose output was allocated above and then not taken: copy-in memory too
    result = AllGatherResult(
        pending=pending,
        send=send,
        recv=recv,
        ranks=ranks,
        params=params,
        dtypes=dtypes,
        as_bytes=as_bytes,
        own=tried_own,
    )
    return queue_copy_out(result, comm, views, copy_out_at_wait)


def own_output(param, gather_dtype, size: tuple, dtype) -> torch.Tensor | None:
    """For a group of one parameter that gathers one tensor: its all-gather output in
    ``gather_dtype``, flat, if it is what the group's all-gather produces (``size`` elements of
    ``dtype``, contiguous); else None (an output of another dtype, kept from an earlier step).
    Allocated on the copy-in stream, which writes it first.

    [Note: one parameter, no copy-out]
    The all-gather lays the ranks' blocks one after another, and a parameter's blocks one
    after another are the parameter, padded: its ``all_gather_output``. With one parameter in
    the group the gathered buffer is therefore exactly that output, and the all-gather fills
    it in place (this rank's block copied into its slot), as the reference gathers into each
    parameter's own buffer: no gathered buffer, no copy-out. With several parameters a
    parameter's rows are spread over the ranks' slots, and the copy-out gathers them. A
    token embedding sharded alone (torchtitan's grouping) is such a group: Llama 3.1 8B's is
    1.05 GB in bf16, a copy of it (and a buffer of its size) at each of its two all-gathers a
    step. Not taken where the group's output comes from elsewhere (a custom all-gather, the
    process group's memory), where the group is gathered as bytes, and for the first
    all-gather of backward, which is copied out on the compute stream ([Note: the first
    all-gather of backward is copied out where it is used] in ``comm.py``).

    The memory is the copy-in stream's, which writes this rank's block into it; the
    all-gather stream then fills the rest, and the compute stream reads it once it has waited
    for the all-gather, as it reads any parameter. The reshard frees it into the copy-in
    stream's pool, and every copy-in waits for that reshard before it allocates again (in
    forward for all the compute queued, in backward for the latest reshard), but the first of
    backward, which waits for nothing: so a reshard that freed such memory makes that one wait
    too (``CommContext.after_reshard``)."""
    (out, *rest) = param.all_gather_outputs(gather_dtype)  # on the copy-in stream
    if rest or out.dtype != dtype or out.numel() != size[0] or not out.is_contiguous():
        return None
    return out.view(-1)  # (ranks * per-rank numel,)


def queue_copy_out(
    result: AllGatherResult, comm: CommContext, views: dict, at_wait: bool = False
) -> AllGatherResult:
    """Queue the copy of every parameter out of the gathered buffer behind the all-gather on
    its stream, and the buffer's release after it (replaces the reference's all-gather
    straight into each parameter's own buffer); see [Note: the copy-out on a stream of its
    own]. Returns ``result`` without its buffers. ``at_wait``: leave the copy to the stream
    that waits for the all-gather instead (``copy_out``), see [Note: the first all-gather of
    backward is copied out where it is used] in ``comm.py``; ``result`` keeps its buffers."""
    r = result
    if at_wait:  # the same record, with the view cache for the copy-out at the wait
        fields = (r.pending, r.send, r.recv, r.ranks, r.params, r.dtypes, r.as_bytes)
        return AllGatherResult(*fields, views=views, own=r.own)
    with comm.on(comm.copy_out_stream):  # the parameters' memory, from that stream's pool
        outs, sizes = gathered_views(result, views)
    comm.after(result.pending, comm.copy_out_stream, CopyOut(result, outs, sizes, comm))
    # the same record, without its buffers: they go with the copy-out
    return AllGatherResult(
        pending=r.pending,
        send=None,
        recv=None,
        ranks=r.ranks,
        params=r.params,
        dtypes=r.dtypes,
        as_bytes=r.as_bytes,
        own=r.own,
    )


class CopyOut:
    """One fused split-copy of every parameter out of the gathered buffer ``recv``, then its
    release: the work ``CommContext.after`` queues behind the all-gather."""

    def __init__(
        self, result: AllGatherResult, outs: list, sizes: list, comm: CommContext, hold=False
    ):
        self.send, self.recv, self.ranks = result.send, result.recv, result.ranks
        self.outs, self.sizes, self.comm, self.hold = outs, sizes, comm, hold

    def __call__(self) -> None:
        gathered = self.recv.view(self.ranks, -1)  # (ranks, per-rank numel)
        torch.split_with_sizes_copy(gathered, self.sizes, dim=1, out=self.outs)
        comm, buffers = self.comm, (self.send, self.recv)
        self.send = self.recv = self.outs = None  # the buffers go with the release
        comm.release_gathered("release of the all_gather buffers", buffers, self.hold)


@without_grad
def copy_out(result: AllGatherResult, comm: CommContext) -> None:
    """Wait for the all-gather and the copy out of it; the parameters are unsharded. A
    result that still holds its gathered buffer is copied out here, on the current stream."""
    comm.wait(result.pending)
    if result.views is not None:
        outs, sizes = gathered_views(result, result.views)  # memory of the current stream
        CopyOut(result, outs, sizes, comm, hold=True)()
    ShardedParam.finish_unshard_all(result.params)
    if result.then is not None:  # a group on several meshes (``meshes.py``)
        copy_out(result.then, comm)


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
    outs = ShardedParam.all_gather_outputs_all(result.params, result.dtypes)
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
