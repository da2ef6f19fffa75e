"""A parameter group that communicates as one: one all-gather, one reduce-scatter per group.

Version 1 of each speed-up below replaces a function of ``twinshard.reference`` (named in its
docstring); everything else (sharding, DTensor state dicts, the per-parameter states, how
unsharded memory is freed) is the reference's own code, reused unchanged.

[Note: one flat buffer per group]
The reference all-gathers each parameter separately: for a block of nine weights that is
nine collectives, each paying the full latency of a round trip. Here the group's blocks are
copied into one flat buffer (rank-major: every rank contributes its blocks of all parameters,
in the same order) and gathered at once; viewing the result as (ranks, per-rank numel) and
splitting along dim 1 hands each parameter its (ranks, chunk * rest) slice, which is exactly
its padded unsharded tensor viewed as (ranks, chunk * rest). Gradients go the other way. The
values are the same as the reference's, element for element: only how many messages carry
them changes. With two ranks every sum has two terms, so results are bitwise equal.

[Note: overlap without streams]
On the CPU, ``unshard_async`` issues the all-gather with ``async_op=True`` and returns at once;
the wait happens only in ``wait_for_unshard``, when the group is about to compute. Between
the two, the previous group computes. Reduce-scatters likewise run while backward continues
into earlier layers; each one is finished (waited on, divided, added to the DTensor
gradients, its buffers freed) at the next group's reduce-scatter or at the end of backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from twinshard.reference.collectives import _all_gather, _reduce_scatter, pad_rows
from twinshard.reference.param_group import ParamGroup, TrainingState
from twinshard.reference.sharded_param import ParamState

from .comm import AllGatherResult, CommContext, ReduceScatterResult


class FlatParamGroup(ParamGroup):
    """The reference's ``ParamGroup`` with batched, asynchronous collectives."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.comm: CommContext | None = None  # set by the root at its first forward
        self.in_flight: AllGatherResult | None = None
        self.partial_reduce: torch.Tensor | None = None  # HSDP without all-reduce

    # --- unshard: one all-gather ------------------------------------------------------------
    @property
    def needs_gather(self) -> bool:
        return any(p.state is not ParamState.UNSHARDED for p in self.params)

    @torch.no_grad()
    def unshard_async(self) -> None:
        """Issue the group's all-gather and return (replaces ``ParamGroup.unshard``'s loop of
        blocking per-parameter all-gathers; see [Note: one flat buffer per group])."""
        if self.in_flight is not None or not self.needs_gather:
            return
        comm = self.comm or self._own_comm()
        with torch.profiler.record_function("twinshard::unshard"):
            post = any(p.state is ParamState.SHARDED_POST_FORWARD for p in self.params)
            group = self.post_forward_mesh.shard_group if post else self.info.shard_group
            size = dist.get_world_size(group)
            comm.before_all_gather()
            if comm.streams:
                with comm.stream(comm.copy_in_stream):
                    send = self._copy_in()
                comm.all_gather_stream.wait_stream(comm.copy_in_stream)
                with comm.stream(comm.all_gather_stream):
                    recv = send.new_empty(size * send.numel())
                    _all_gather(recv, send, group=group)
                    event = comm.all_gather_stream.record_event()
                self.in_flight = AllGatherResult(None, event, send, recv, size)
            else:
                send = self._copy_in()
                recv = send.new_empty(size * send.numel())
                work = _all_gather(recv, send, group=group, async_op=True)
                self.in_flight = AllGatherResult(work, None, send, recv, size)

    def _copy_in(self) -> torch.Tensor:
        """This rank's blocks of every parameter, padded and cast, in one flat tensor."""
        blocks = []
        for p in self.params:
            if p.state is ParamState.SHARDED:
                p.refresh()
                local = p.sharded_param.to_local()  # (<= chunk, *rest)
                blocks.append(pad_rows(local.to(self.device, self.param_dtype(p),
                                                non_blocking=True), p.chunk).reshape(-1))
            else:  # SHARDED_POST_FORWARD: the kept 1/N piece
                blocks.append(p.post_forward_block.reshape(-1))
        return torch.cat(blocks)  # (per-rank numel,)

    @torch.no_grad()
    def wait_for_unshard(self) -> None:
        """Wait for the all-gather and copy each parameter out of the flat result, with one
        fused split-copy (replaces the reference's per-parameter ``ShardedParam.unshard``)."""
        result, self.in_flight = self.in_flight, None
        if result is None:
            return
        comm = self.comm
        comm.wait(result)
        with torch.profiler.record_function("twinshard::copy_out"):
            outs, sizes = [], []
            for p in self.params:
                p._allocate_unsharded(self.param_dtype(p))
                outs.append(p.padded.view(result.group_size, -1))  # (size, numel / size)
                sizes.append(outs[-1].shape[1])
            recv = result.recv.view(result.group_size, -1)  # (size, per-rank numel)
            torch.split_with_sizes_copy(recv, sizes, dim=1, out=outs)
            for p in self.params:
                p.post_forward_block = None
                p.unsharded_param.requires_grad_(p.sharded_param.requires_grad)
                p._register(p.unsharded_param)
                p.state = ParamState.UNSHARDED
        if comm.streams:  # keep the buffers until the streams that made them have waited
            comm.last_all_gather = ((result.send, result.recv), comm.current_stream().record_event())

    def unshard(self) -> None:
        """Blocking unshard, as the reference's (used by explicit ``unshard()`` and hooks)."""
        self.unshard_async()
        self.wait_for_unshard()

    @torch.no_grad()
    def reshard(self, after_forward: bool = False) -> None:
        self.wait_for_unshard()  # a prefetched gather that nobody used: finish, then free
        super().reshard(after_forward)

    def _own_comm(self) -> CommContext:
        self.comm = CommContext(self.device)  # used before any root forward (explicit unshard)
        return self.comm

    # --- reduce: one reduce-scatter -----------------------------------------------------------
    @torch.no_grad()
    def post_backward(self) -> None:
        """Take the gradients and issue one reduce-scatter for the group (replaces
        ``ParamGroup.post_backward``'s per-parameter blocking reductions)."""
        self.state = TrainingState.POST_BACKWARD
        comm = self.comm or self._own_comm()
        with torch.profiler.record_function("twinshard::post_backward"):
            for p in self.params:
                p.take_grad(self.reduce_dtype(p))
            if self.reduce_grads:
                finish_reduce(comm)  # the previous group's gradient buffers are freed here
                comm.pending_reduce = self._reduce_scatter_async(comm)
            if self.reshard_after_backward:
                self.reshard()

    def _reduce_scatter_async(self, comm: CommContext) -> ReduceScatterResult | None:
        params = [p for p in self.params if p.grad_to_reduce is not None]
        if not params:
            return None
        S = self.info.shard_size
        grads = [pad_rows(p.grad_to_reduce, S * p.chunk).view(S, -1) for p in params]
        for p in params:
            p.grad_to_reduce = None
        flat = torch.cat(grads, dim=1).view(-1)  # (S * per-rank numel,) rank-major
        if comm.streams:
            comm.reduce_scatter_stream.wait_stream(comm.current_stream())
            with comm.stream(comm.reduce_scatter_stream):
                out = flat.new_empty(flat.numel() // S)
                _reduce_scatter(out, flat, group=self.info.shard_group)
                if self.info.replicate_group is not None and self.all_reduce_grads:
                    comm.all_reduce_stream.wait_stream(comm.reduce_scatter_stream)
            event = self._all_reduce_on_stream(comm, out)
            return ReduceScatterResult(None, event, flat, out, self, params)
        out = flat.new_empty(flat.numel() // S)
        work = _reduce_scatter(out, flat, group=self.info.shard_group, async_op=True)
        return ReduceScatterResult(work, None, flat, out, self, params)

    def _all_reduce_on_stream(self, comm: CommContext, out: torch.Tensor):
        if self.info.replicate_group is None or not self.all_reduce_grads:
            return comm.reduce_scatter_stream.record_event()
        with comm.stream(comm.all_reduce_stream):
            if self.partial_reduce is not None:
                out += self.partial_reduce
                self.partial_reduce = None
            dist.all_reduce(out, group=self.info.replicate_group)
            return comm.all_reduce_stream.record_event()

    def finish_backward(self) -> None:
        if self.state is not TrainingState.POST_BACKWARD and any(
            p.unsharded_param is not None and p.unsharded_param.grad is not None
            for p in self.params
        ):
            self.post_backward()
        elif self.reshard_after_backward:
            self.reshard()
        self.state = TrainingState.IDLE


@torch.no_grad()
def finish_reduce(comm: CommContext) -> None:
    """Wait for the pending reduce-scatter and add the result to the sharded gradients
    (replaces ``ShardedParam.reduce_grad``'s divide and ``_accumulate``, batched with
    foreach ops)."""
    result, comm.pending_reduce = comm.pending_reduce, None
    if result is None:
        return
    group = result.group
    comm.wait(result)
    out = result.out  # (per-rank numel,) summed over the shard group
    if group.info.replicate_group is not None and not comm.streams:
        if group.partial_reduce is not None:
            out += group.partial_reduce
            group.partial_reduce = None
        if not group.all_reduce_grads:
            group.partial_reduce = out  # summed over the shard group only, for now
            return
        dist.all_reduce(out, group=group.info.replicate_group)
    elif group.info.replicate_group is not None and not group.all_reduce_grads:
        group.partial_reduce = out
        return
    info = group.info
    out = out / (group.divide_factor or info.shard_size * info.replicate_size)
    news, olds, fresh = [], [], []
    offset = 0
    for p in result.params:
        numel = p.chunk * p.shape[1:].numel()
        block = out[offset:offset + numel].view(p.chunk, *p.shape[1:])  # (chunk, *rest)
        offset += numel
        local_rows = p.sharded_param.to_local().shape[0]
        block = block[:local_rows].to(p.sharded_param.dtype).to(p.shard_device, non_blocking=True)
        if p.sharded_param.grad is None:
            fresh.append((p, block))
        else:
            olds.append(p.sharded_param.grad.to_local())
            news.append(block)
    if olds:
        torch._foreach_add_(olds, news)
    for p, block in fresh:
        p.sharded_param.grad = p._as_dtensor(block.contiguous())
