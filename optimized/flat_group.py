"""A parameter group that communicates as one and does not wait for what it does not need yet.

``FlatParamGroup`` is the reference's ``ParamGroup`` (the hooks' view of a group: pre/post
forward, pre/post backward, the FSDPModule settings) with the three methods that issue
collectives replaced:

- ``unshard`` is split in two: ``unshard_async`` issues the group's one all-gather
  (``collectives.all_gather``) and returns; ``wait_for_unshard`` waits and copies out
  (``collectives.copy_out``). The hooks call the first early (prefetch, ``state.py``) and the
  second right before the group computes.
- ``reduce_grads_now`` issues the group's one reduce-scatter (``collectives.reduce_scatter``)
  and finishes the previous group's (``collectives.accumulate``): gradients of group g are
  added while the backward of group g - 1 runs.
- ``reshard`` first finishes an all-gather still in flight, so no collective is left behind.

[Note: overlap on the CPU]
On the CPU the all-gather is issued with ``async_op=True`` and returns at once; the wait
happens only in ``wait_for_unshard``, when the group is about to compute. Between the two, the
previous group computes while gloo's threads move the data. Reduce-scatters likewise run while
backward continues into earlier layers.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist

from twinshard.api import MixedPrecisionPolicy, profiled, without_grad, write_count
from twinshard.api.comm_memory import SymmetricMemory
from twinshard.reference.mesh import MeshInfo
from twinshard.reference.param_group import TrainingState
from twinshard.reference.sharded_param import ParamState, ShardedParam

from .collectives import AllGatherResult, all_gather, copy_out
from .comm import CommContext
from .kept_blocks import KeptBlocks
from .meshes import gather_each_mesh, mesh_parts
from .reduction import accumulate, reduce_scatter

# Separate reduce-scatter process groups, one per set of shard ranks, each with the default
# group it was made in: after destroy_process_group and a new one, the old ones are dropped.
SEPARATE_GROUPS: dict[tuple, tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}

# Read at every unshard, once per parameter. On Python 3.11 a member read from the Enum class
# goes through its metaclass (77 ns against 29 ns for a global); the loops reading globals here
# and in ``kept_blocks.py`` took about 70,000 instructions off each group and step
# (benchmarks/instructions.py).
UNSHARDED = ParamState.UNSHARDED


class FlatParamGroup(KeptBlocks):
    """The reference's ``ParamGroup`` with batched, asynchronous collectives, keeping its
    blocks in storage of its own (``KeptBlocks``, ``kept_blocks.py``)."""

    def __init__(
        self,
        params: list[ShardedParam],
        info: MeshInfo,
        post_forward: MeshInfo | None,
        mp: MixedPrecisionPolicy,
    ):
        super().__init__(params, info, post_forward, mp)
        self.comm: CommContext | None = None  # the root's, shared; set at its first forward
        self.in_flight: AllGatherResult | None = None  # issued, not yet copied out
        self.holds_unsharded = False  # copied out since the last reshard
        self.holds_own = False  # the parameter's memory is the copy-in stream's (one-parameter)
        self.root_group = False  # the root's: see [Note: a prefetch reads the shards when ...]
        self.prefetched = False  # a forward prefetch whose copy-in is not yet ordered
        self.watched: list | None = None  # see [Note: an edit after an implicit prefetch]
        self.pieces: list[FlatParamGroup] = []  # cut from its module (``optimized/pieces.py``)
        self.read_version = 0  # the sum of their version counters when the prefetch read them
        self.edited = False  # the next copy-in waits for an edit on the current stream
        self.reduce_scatter_group = None  # set_separate_reduce_scatter_group
        self.force_sum_reduction = False  # set_force_sum_reduction_for_comms
        self.reductions_in_flight = 1  # set_reduce_scatter_max_input_buffers
        self.comm_memory = None  # set_allocate_memory_from_process_group_for_comm, ...symm_mem
        self.take_params(self.params)

    def take_params(self, params: list, kept: list | None = None) -> None:
        """Hold ``params`` from now on: at construction, and when a group is cut in two
        (``split_off``), with ``kept``, each one's kept block and view, which stay as they are."""
        self.params, self.usage = params, {}
        self.views: dict = {}  # see [Note: the copy-out views are kept]
        self.gathered_from: dict = {}  # per ShardedParam: the DTensor its last all-gather read
        # each parameter's block, (numel, shape, contiguous strides): fixed when it was sharded
        self.blocks = {p: block_of(p.block_shape) for p in self.params}
        self.one_mesh = len(mesh_parts(self.params)) == 1
        self.setup_kept_blocks(self.one_mesh, kept)

    def split_off(self, params: list) -> FlatParamGroup:
        """A group of ``params``, some of this group's, with this group's settings; this group
        keeps the rest. Before the first forward (``fully_shard`` of the root, [Note: the first
        block in two pieces] in ``pieces.py``): nothing is in flight or unsharded."""
        piece = copy.copy(self)
        piece.pieces, piece.comms = [], copy.copy(self.comms)  # its own hooks from now on
        kept = dict(zip(self.params, zip(self.kept_blocks, self.kept_views)))
        for group, mine in ((piece, params), (self, [p for p in self.params if p not in params])):
            group.take_params(mine, [kept[p] for p in mine])
        return piece

    def use_comm(self, comm: CommContext) -> None:
        """Share ``comm`` (the root's) from now on."""
        self.comm = comm

    def own_comm(self) -> CommContext:
        """The shared context; before the root's first forward (an explicit ``unshard()``) a
        context of the group's own, which the root's first forward replaces."""
        if self.comm is None:
            self.comm = CommContext(self.device)
        return self.comm

    def use_separate_reduce_scatter_group(self, enable: bool) -> None:
        """Reduce-scatter on a process group of its own, over the same ranks as the shard group
        (one per set of ranks, shared by the groups on them), or on the shard group again."""
        if not enable:
            self.reduce_scatter_group = None
            return
        ranks = tuple(dist.get_process_group_ranks(self.info.shard_group))
        if any(world is not dist.group.WORLD for world, _ in SEPARATE_GROUPS.values()):
            SEPARATE_GROUPS.clear()  # made in a world that is gone: none of them serves now
        if ranks not in SEPARATE_GROUPS:
            group = dist.new_group(list(ranks), use_local_synchronization=True)
            SEPARATE_GROUPS[ranks] = (dist.group.WORLD, group)
        self.reduce_scatter_group = SEPARATE_GROUPS[ranks][1]

    # --- unshard: one all-gather, issued early ---------------------------------------------------
    def unshard_async(self) -> None:
        """Issue the group's all-gather and return (replaces ``ParamGroup.unshard``'s loop of
        blocking per-parameter all-gathers). The hooks call it for a group that a prefetch may
        have started already; then there is nothing to do, and that costs one test."""
        if self.in_flight is None:
            self.issue_all_gather()

    def prefetch(self, order_now: bool = True) -> bool:
        """``unshard_async`` for a group that computes later: a prefetch, or the user's
        ``unshard(async_op=True)``. Returns whether it issued an all-gather. ``order_now``:
        order the current stream after its copy-in here; the hooks pass False and order it
        themselves, later (``FSDPState.prefetch``).

        [Note: a prefetch reads the shards when it is issued]
        An early all-gather copies the shards in when it is issued, and user code may write
        them before the group computes: a forward pre-hook registered with ``prepend=True``,
        the parent's forward. The rule (``docs/optimized-path.md``, the conformance case
        ``edit_between_forwards``) is that such a write is never seen half: after an implicit
        prefetch the group is gathered again ([Note: an edit after an implicit prefetch]),
        after an explicit list's the write is seen from the next all-gather on. On the CPU the copy-in runs at once, so that holds by itself; on an
        accelerator the copy-in is queued on its own stream, which the write on the current
        stream could overtake. So the current stream waits for the copy-in (an event right
        after it) before such code runs: a block waits in its post-forward hook, after its own
        forward, beside which the copy-in ran; the root, whose own forward code (the parent's)
        runs right after its pre-forward, waits at the end of that hook. Waiting right at the
        issue stalled the compute stream for the whole copy-in, 0.09 ms per block and pass in
        the plan of Llama-2-7B on 8 H100s (5.7 ms of exposed time a step). A block's own
        forward code is not expected to write another block's shards. In backward nothing of
        the user's runs between a prefetch
        and the prefetched group's own wait for its all-gather that could write its shards
        (an optimizer stepped in backward writes a group's shards after the group's backward,
        never before it), so there is nothing to order. Stand-in streams report a write that
        overtakes a copy-in as a race."""
        issued = self.in_flight is None
        if issued:
            self.unshard_async()
            issued = self.in_flight is not None  # None: nothing to gather
        if issued and order_now:
            self.own_comm().after_copy_in()
        return issued

    def watch_for_edits(self) -> None:
        """Note the version of each shard that an implicit forward prefetch has just read.

        [Note: an edit after an implicit prefetch]
        torch's ``fully_shard`` gathers a group at its own pre-forward unless an explicit
        prefetch list says otherwise, so its forward sees an edit of the group's shards made
        after the previous group's pre-forward (by a forward pre-hook registered with
        ``prepend=True``, or the parent's forward). The implicit prefetch read the shards
        earlier, so the hooks note each shard's version counter when they issue it, and the
        group's own pre-forward compares (``gather_again_if_edited``): where one moved, the
        stale all-gather is waited for and freed, and the group is gathered again, its copy-in
        after the edit. The check reads two host counters per parameter and syncs nothing; an
        edit costs a second all-gather of the group. Every rank must make the same edits,
        as with every write to sharded parameters in SPMD training: a rank that edited and
        one that did not would issue different collectives. An explicit
        ``set_modules_to_forward_prefetch`` list reads early, as torch's does."""
        # Two counters a parameter: an in-place op on the DTensor counts on it, not on its
        # local tensor (DTensor's dispatch writes that below autograd); a write through
        # ``to_local()`` counts on the local tensor. Counters only grow, so their sum moves
        # with any write.
        self.watched = [t for p in self.params for t in (p.sharded_param, p.local_shard)]
        self.read_version = write_count(self.watched)

    def gather_again_if_edited(self) -> None:
        """Gather again where a shard was edited since the implicit prefetch read it; see
        [Note: an edit after an implicit prefetch]."""
        watched, self.watched = self.watched, None
        if self.in_flight is None or write_count(watched) == self.read_version:
            return
        self.reshard()  # waits for the stale all-gather, then frees what it gathered
        self.edited = True

    @without_grad
    def issue_all_gather(self) -> None:
        params = [p for p in self.params if p.state is not UNSHARDED]
        if not params:
            return
        with profiled("twinshard::unshard"):
            kept = self.kept_shards(params)
            self.gathered_kept = kept is not None
            if kept is not None:  # see [Note: shards written after the optimizer step]
                written, self.moved_blocks = self.moved_blocks, False
            else:
                written = self.replaced_since_gather(params)
            if self.edited:  # see [Note: an edit after an implicit prefetch]
                written, self.edited = True, False
            # kept blocks keep the dtype they were moved in with (``keep_shards``)
            dtypes = self.kept_dtypes if kept is not None else self.param_dtypes(params)
            if not self.one_mesh:  # one all-gather per mesh: ``meshes.py``
                self.in_flight = gather_each_mesh(self, params, written)
                return
            # A group's parameters change state together, so they all gather over one mesh.
            mesh = params[0].all_gather_mesh(self.post_forward_info)
            comm, custom = self.own_comm(), self.comms.all_gather
            self.in_flight = all_gather(
                params,
                dtypes,
                mesh,
                comm,
                custom=custom,
                kept=kept,
                after_current=written,
                memory=self.comm_memory,
                views=self.views,
            )

    def replaced_since_gather(self, params: list) -> bool:
        """Whether the user gave any of ``params`` new memory (``load_state_dict(assign=True)``,
        ``to_empty``) since its last all-gather; each one is adopted
        (``ShardedParam.refresh``).

        [Note: shards written after the optimizer step]
        With ``set_post_optim_event`` the copy-in waits only on that event, not on everything the
        compute stream queued. Whatever writes shards on the compute stream after the event
        must therefore make the copy-in wait for the compute stream too: moving blocks into the
        group's storage (``keep_shards``) and parameters given new memory, which the user's
        code wrote there. Values loaded in place after the event are the user's to order, as
        with torch's ``fully_shard``."""
        replaced = False
        for p in params:
            p.refresh()
            if self.gathered_from.get(p) is not p.sharded_param:
                self.gathered_from[p] = p.sharded_param
                replaced = True
        return replaced

    def wait_for_unshard(self) -> None:
        """Wait for the all-gather in flight, if any, and copy the parameters out of it."""
        result, self.in_flight = self.in_flight, None
        if result is not None:
            self.holds_unsharded = True  # before the copy-out: a failed one is freed too
            self.holds_own = result.own
            with profiled("twinshard::copy_out"):
                copy_out(result, self.comm)

    def unshard(self, meanwhile: Callable[[], None] | None = None) -> None:
        """Issue the group's all-gather, run ``meanwhile`` (the contract's "issue now, wait
        later": the hooks pass their state's ``while_gathering``, which issues the next
        group's all-gather), and wait. In forward ``meanwhile`` runs before the wait, in
        backward after it: see [Note: in forward, the next all-gather goes out before the
        copy-out] in ``state.py``. Without ``meanwhile`` (``unshard()``, a forward recomputed in
        backward) it is the reference's blocking unshard."""
        comm = self.own_comm()
        if meanwhile is not None and self.state is TrainingState.FORWARD and not comm.in_forward:
            comm.start_forward()  # the first group's pre-forward starts the step
        if self.watched is not None:
            self.gather_again_if_edited()
        self.unshard_async()
        early = meanwhile is not None and self.state is TrainingState.FORWARD
        if early:
            meanwhile()
        self.wait_for_unshard()
        if early and self.prefetched and self.root_group:  # the parent's code runs next
            self.order_prefetch()
        elif meanwhile is not None and not early:
            meanwhile()

    def order_prefetch(self) -> None:
        """Order the current stream after the copy-in of the forward prefetch this group's
        hook issued; see [Note: a prefetch reads the shards when it is issued]."""
        self.comm.after_copy_in()
        self.prefetched = False

    def post_forward(self) -> None:
        """Note the order groups finish forward in, and order the current stream after this
        group's prefetch (the next group's pre-hooks and the parent's code run next); then the
        reference's."""
        finished = self.own_comm().current_post_order
        if self.state is TrainingState.FORWARD and self not in finished:
            finished.append(self)
        if self.prefetched:
            self.order_prefetch()
        super().post_forward()

    @without_grad
    def reshard(self, after_forward: bool = False) -> None:
        """Free the unsharded parameters (the reference's ``reshard``; the contract's
        group-level ``reshard_all`` where none keeps a piece), first finishing an all-gather
        still in flight; nothing to do for a group that holds none. The copy-out
        is the only way parameters of this group become unsharded, so ``holds_unsharded``
        tells, without asking each parameter: the end of every backward reshards all groups,
        and most have been resharded by their post-backward already."""
        self.wait_for_unshard()  # a prefetched gather that nobody used: finish, then free
        if not self.holds_unsharded:
            return
        piece = self.post_forward_info
        if after_forward and piece is not None and piece is not self.info:
            super().reshard(after_forward)  # each keeps a piece for backward
        else:
            with profiled("twinshard::reshard"):
                ShardedParam.reshard_all(self.params)
        self.holds_unsharded = False
        self.own_comm().after_reshard(self.holds_own)

    # --- reduce: one reduce-scatter, finished one group later ---------------------------------------
    def reduce_scatter_memory(self):
        """Where the reduce-scatter's buffers come from (``twinshard/api/comm_memory.py``): symmetric memory
        only for a reduce-scatter that sums (NCCL's symmetric reduce-scatter knows no mean)."""
        if isinstance(self.comm_memory, SymmetricMemory) and not self.force_sum_reduction:
            return None
        return self.comm_memory

    def reduce_ops(self, dtype: torch.dtype, info) -> tuple:
        """What gradients reduced in ``dtype`` over ``info``'s ranks (a ``MeshInfo``) are
        divided by before the collectives (None:
        nothing), the collectives' reduce op, and what their result is divided by (None:
        nothing): the reference's ``gradient_divisors`` around a SUM, or a mean taken by the
        collectives themselves; see [Note: the mean on the wire] in ``reduction.py``."""
        before, after = self.gradient_divisors(dtype, info)
        ranks = info.shard_size * info.replicate_size  # data-parallel
        if before is None and after == ranks > 1 and not self.force_sum_reduction:
            return None, dist.ReduceOp.AVG, None
        return before, dist.ReduceOp.SUM, None if after == 1 else after

    def reduce_grads_now(self) -> None:
        """Finish the previous group's reduction and issue this group's: one reduce-scatter
        per reduce dtype, usually one in all (replaces the reference's loop of blocking
        per-parameter reductions)."""
        comm = self.own_comm()
        # the previous groups' gradients are added, their buffers freed, but for the newest
        # reductions_in_flight - 1 (see [Note: reductions in flight])
        finish_reduce(comm, keep=self.reductions_in_flight - 1)
        by_kind: dict[tuple, list] = {}  # per reduce dtype and mesh (several: ``meshes.py``)
        for p, dtype in zip(self.params, self.reduce_dtypes(self.params)):
            by_kind.setdefault((dtype, id(p.info)), []).append(p)
        for (dtype, _), params in by_kind.items():
            info = params[0].info
            own = info is self.info  # the group's mesh, which the settings below are for
            result = reduce_scatter(
                params,
                dtype,
                info,
                all_reduce=self.all_reduce_grads,
                ops=self.reduce_ops(dtype, info),
                comm=comm,
                blocks=self.blocks,
                custom=self.comms.reduce_scatter,
                keep_unused=self.reduce_unused,
                group=self.reduce_scatter_group if own else None,
                memory=self.reduce_scatter_memory() if own else None,
            )
            if result is not None:
                self.usage.update(zip(result.params, result.used))
                comm.pending_reduce.append((result, self.comms.all_reduce_hook))


def block_of(shape: torch.Size) -> tuple:
    """A block of ``shape``: its numel, its shape as a tuple and its contiguous strides."""
    return shape.numel(), tuple(shape), torch.empty(shape, device="meta").stride()


def finish_reduce(comm: CommContext, keep: int = 0) -> None:
    """Add the gradients of the reductions in flight, if any, to the sharded gradients, all
    but the newest ``keep``.

    [Note: reductions in flight]
    A group's reduction is finished (waited for, its packed buffer freed, its gradients made)
    at the next group's post-backward, so one reduce-scatter is in flight while a group
    computes. Where the reduce-scatter takes longer than a group's backward, that wait stalls
    the compute stream. ``set_reduce_scatter_max_input_buffers(K)`` keeps up to K in flight: a
    group's post-backward finishes only the reductions older than the newest K - 1, so the
    compute stream waits for the reduce-scatter issued K groups earlier, at the cost of K
    packed buffers alive at once instead of one. The end of backward finishes them all. The
    order in which gradients are made does not change, so neither do their values."""
    pending = comm.pending_reduce
    cut = max(len(pending) - keep, 0)
    pending, comm.pending_reduce = pending[:cut], pending[cut:]
    for result, hook in pending:
        with profiled("twinshard::accumulate"):
            accumulate(result, comm, hook)
