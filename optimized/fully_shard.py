"""``fully_shard`` of the optimized implementation.

The same steps as ``twinshard.reference.fully_shard`` (collect, shard, attach hooks, change
the class), reusing its checks and its sharded parameters; what differs is the group
(``FlatParamGroup``: one collective per group, asynchronous) and the hooks (``FSDPState``:
prefetch). The FSDPModule methods are the reference's, plus real prefetch lists and a real
asynchronous ``unshard``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from twinshard.api import (
    FSDPUsageError,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
    check_fsdp_modules,
    register_fsdp_forward_method,
)
from twinshard.api.arguments import check_module
from twinshard.api.comm_memory import ProcessGroupMemory, SymmetricMemory
from twinshard.reference.fully_shard import Implementation, shard_module
from twinshard.reference.more.fsdp_module import FSDPModule as ReferenceModule
from twinshard.reference.more.fsdp_module import states_below
from twinshard.reference.state import get_state

from .comm import CommContext
from .flat_group import FlatParamGroup
from .pieces import (
    also_on_pieces,
    explain_a_failed_forward,
    first_cut,
    pieces_of,
)
from .state import FSDPState


def fully_shard(
    module: nn.Module,
    *,
    mesh=None,
    reshard_after_forward: bool | int | None = None,
    mp_policy=MixedPrecisionPolicy(),
    offload_policy=OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    shard_placement_fn=None,
    dp_mesh_dims=None,
) -> nn.Module:
    """Shard ``module`` like ``twinshard.reference.fully_shard``, communicating per group and
    overlapping communication with compute."""
    return sharded(
        module,
        False,
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params=ignored_params,
        shard_placement_fn=shard_placement_fn,
        dp_mesh_dims=dp_mesh_dims,
    )


def sharded(
    module,
    in_pieces: bool,
    *,
    mesh,
    reshard_after_forward,
    mp_policy,
    offload_policy,
    ignored_params,
    shard_placement_fn,
    dp_mesh_dims,
):
    """``fully_shard``'s steps; with ``in_pieces``, a parent of sharded modules is sharded in
    pieces first ([Note: the root's parameters in pieces] in ``pieces.py``)."""

    def shard(m):
        return shard_module(
            m,
            Implementation(group_type=FlatParamGroup, state_type=FSDPState, module_type=FSDPModule),
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            ignored_params=ignored_params,
            shard_placement_fn=shard_placement_fn,
            dp_mesh_dims=dp_mesh_dims,
        )

    runs = pieces_of(module, set(ignored_params or ())) if in_pieces else []
    if runs:
        check_module(module, get_state(module))  # before any piece of it is sharded
    pieces = [get_state(shard(run)[0]) for run in runs]
    done = shard(module)
    state = get_state(done[0] if isinstance(done, (list, tuple)) else done)
    state.pieces = pieces
    if pieces:
        explain_a_failed_forward(module, pieces)
    if state.group is not None:
        state.group.pieces = [s.group for s in pieces if s.group is not None]
    for group in [s.group for s in [state, *pieces] if s.group is not None]:
        keep_shards_after_loads(group)
    if in_pieces:
        cut_first_block(module)
    return done


def cut_first_block(module: nn.Module) -> None:
    """Cut the first sharded block below ``module`` before its last child holding parameters
    (``first_cut``): that child's parameters become a group of their own
    (``FlatParamGroup.split_off``), held by a state of their own, which ``fully_shard``'s steps
    make for the child with the block's settings and its parameters left out; see [Note: the
    first block in two pieces] in ``pieces.py``."""
    cut = first_cut(module)
    if cut is None:
        return
    state, child, taken = cut
    shard_module(
        child,
        Implementation(group_type=FlatParamGroup, state_type=FSDPState, module_type=FSDPModule),
        mesh=state.group.info.mesh,
        reshard_after_forward=None if state.auto_reshard_after_forward else True,
        mp_policy=state.mp,
        offload_policy=OffloadPolicy(),
        ignored_params=set(child.parameters()),  # they are the block's group's, cut off below
        shard_placement_fn=None,
        dp_mesh_dims=None,  # the block's mesh is its data-parallel one already
    )
    piece = get_state(child)
    piece.group = state.group.split_off(taken)
    state.pieces, state.group.pieces = [piece], [piece.group]
    explain_a_failed_forward(state.module, [piece])
    for m in piece.group.modules_with_params():  # resharded first, as make_fsdp_modules has it
        m.register_state_dict_pre_hook(lambda *args, g=piece.group, **kwargs: g.reshard())
        m.register_load_state_dict_pre_hook(lambda *args, g=piece.group: g.reshard())
    keep_shards_after_loads(piece.group)


def keep_shards_after_loads(group: FlatParamGroup) -> None:
    """After a ``load_state_dict`` into a module of ``group``, keep the blocks the load may have
    replaced ([Note: the kept blocks alias the sharded parameters] in ``kept_blocks.py``)."""
    for m in group.modules_with_params():
        m.register_load_state_dict_post_hook(lambda *args, g=group: g.keep_shards_now())


class _Handle(UnshardHandle):
    def __init__(self, groups: list[FlatParamGroup]):
        self.groups = groups

    def wait(self) -> None:
        for group in self.groups:
            group.wait_for_unshard()


class FSDPModule(ReferenceModule):
    """The reference's methods, with an asynchronous ``unshard`` and real prefetch lists."""

    def _fsdp_unshard(self, wait: bool):
        state = get_state(self)  # no lazy init: an unshard must not make a child a root
        groups = [s.group for s in [state, *state.pieces] if s.group is not None]
        if not groups:
            return None if wait else UnshardHandle()
        if not wait:
            for group in groups:
                group.prefetch()
            return _Handle(groups)
        for group in groups:
            group.unshard()
        return None

    # the methods that act on the module's own group act on its pieces' too
    reshard = also_on_pieces(ReferenceModule.reshard)
    set_gradient_divide_factor = also_on_pieces(ReferenceModule.set_gradient_divide_factor)
    set_unshard_in_backward = also_on_pieces(ReferenceModule.set_unshard_in_backward)
    set_custom_all_gather = also_on_pieces(ReferenceModule.set_custom_all_gather)
    set_custom_reduce_scatter = also_on_pieces(ReferenceModule.set_custom_reduce_scatter)
    set_all_reduce_hook = also_on_pieces(ReferenceModule.set_all_reduce_hook)
    set_reshard_after_forward = also_on_pieces(ReferenceModule.set_reshard_after_forward)
    set_reshard_after_backward = also_on_pieces(ReferenceModule.set_reshard_after_backward)
    set_requires_gradient_sync = also_on_pieces(ReferenceModule.set_requires_gradient_sync)
    set_requires_all_reduce = also_on_pieces(ReferenceModule.set_requires_all_reduce)
    set_reduce_scatter_unused_params = also_on_pieces(
        ReferenceModule.set_reduce_scatter_unused_params
    )

    def _apply(self, *args, **kwargs):
        # The reference's (reshard, then nn.Module's), and the new local tensors move into the
        # group's storage at once; see [Note: the kept blocks alias the sharded parameters].
        module = super()._apply(*args, **kwargs)
        if (group := get_state(self).group) is not None:
            group.keep_shards_now()
        return module

    def set_modules_to_forward_prefetch(self, modules) -> None:
        get_state(self).forward_hint = check_fsdp_modules(
            modules, "set_modules_to_forward_prefetch"
        )

    def set_modules_to_backward_prefetch(self, modules) -> None:
        get_state(self).backward_hint = check_fsdp_modules(
            modules, "set_modules_to_backward_prefetch"
        )

    def set_post_optim_event(self, event) -> None:
        state = get_state(self)
        state.lazy_init()
        state.comm.set_post_optim_event(event)

    @also_on_pieces
    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        super().set_allocate_memory_from_process_group_for_comm(enable)  # checks
        if (group := get_state(self).group) is not None:  # this module's group, as torch's
            group.comm_memory = ProcessGroupMemory(group.info.shard_group) if enable else None

    @also_on_pieces
    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        super().set_symm_mem_for_comm(backend)  # checks
        if (group := get_state(self).group) is not None:
            if group.comms.all_gather or group.comms.reduce_scatter:
                raise FSDPUsageError(
                    "set_symm_mem_for_comm cannot be used with a custom all-gather or "
                    "reduce-scatter (set_custom_*), which allocates its own buffers"
                )
            group.comm_memory = SymmetricMemory(group.info.shard_group, backend)

    @also_on_pieces
    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        super().set_force_sum_reduction_for_comms(enable)  # checks the flag
        if (group := get_state(self).group) is not None:  # this module's group, as torch's
            group.force_sum_reduction = enable

    @also_on_pieces
    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """Keep up to ``max_input_buffers`` reductions in flight; see [Note: reductions in
        flight] in ``flat_group.py``."""
        super().set_reduce_scatter_max_input_buffers(max_input_buffers, recurse=recurse)
        for state in states_below(self, recurse):
            if state.group is not None:
                state.group.reductions_in_flight = max_input_buffers

    @also_on_pieces
    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True):
        super().set_separate_reduce_scatter_group(enable, recurse=recurse)  # checks the flag
        for state in states_below(self, recurse):
            if state.group is not None:
                state.group.use_separate_reduce_scatter_group(enable)


def share_comm_ctx(modules: list) -> None:
    """Let several roots (the stages of a pipeline) share one communication context: the same
    side streams, so memory is not split between stream pools. Call it before their first
    forward, or after: the roots' subtrees switch to the shared context either way."""
    states = [get_state(m) for m in modules]
    if any(s is None for s in states):
        bad = next(m for m, s in zip(modules, states) if s is None)
        raise FSDPUsageError(
            f"share_comm_ctx expects modules that fully_shard was applied to; "
            f"{type(bad).__name__} is not one"
        )
    if not states:
        return
    shared = next((s.comm for s in states if s.comm is not None), None)
    if shared is None:
        device = next((s.group.device for s in states if s.group is not None), None)
        shared = CommContext(device if device is not None else torch.device("cpu"))
    for state in states:
        for s in state.all_states or [state]:
            s.use_comm(shared)


__all__ = ["FSDPModule", "fully_shard", "register_fsdp_forward_method", "share_comm_ctx"]
