"""Second reading. The methods ``fully_shard`` adds to a module: ``FSDPModule``.

Each method is documented once, on ``twinshard.api.FSDPModule``; here it reaches the module's
group, or with ``recurse`` every group below it. Settings that tune an overlapped
implementation (modules to gather early, the post-optimizer event, ...) are checked by
``twinshard.api`` and change nothing here: one stream has nothing to overlap. A sharded module
is also torch's ``FSDPModule``, for libraries that test ``isinstance``, and torch's
``register_fsdp_forward_method`` reaches it through ``_get_fsdp_state``.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem

import twinshard.api.arguments as arguments
from twinshard.api import FSDPModule as FSDPModuleContract
from twinshard.api import UnshardHandle, fsdp_class

from ..param_group import ParamGroup
from ..state import FSDPState, get_state


def states_below(module: nn.Module, recurse: bool) -> list[FSDPState]:
    """The FSDP states of ``module`` and, with ``recurse``, of every module below it."""
    modules = module.modules() if recurse else [module]
    return list({id(s): s for m in modules if (s := get_state(m)) is not None}.values())


def groups_below(module: nn.Module, recurse: bool) -> list[ParamGroup]:
    return [s.group for s in states_below(module, recurse) if s.group is not None]


class FSDPModule(FSDPModuleContract):
    """The reference's FSDPModule; each method is documented on ``twinshard.api.FSDPModule``."""

    def _fsdp_unshard(self, wait: bool) -> UnshardHandle | None:
        # No lazy init here: an unshard before the first forward must not make a child a root.
        if (group := get_state(self).group) is not None:
            group.unshard()  # blocking: the handle below is already complete
        return None if wait else UnshardHandle()

    def reshard(self) -> None:
        if (group := get_state(self).group) is not None:
            group.reshard()

    # --- gradient synchronization ------------------------------------------------------------
    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        for group in groups_below(self, recurse):
            group.reduce_grads = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        for group in groups_below(self, recurse):
            group.all_reduce_grads = requires_all_reduce

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        for group in groups_below(self, recurse):
            group.reduce_unused = bool(reduce_scatter_unused_params)

    def set_gradient_divide_factor(self, factor: float) -> None:
        arguments.check_divide_factor(factor)
        if (group := get_state(self).group) is not None:
            group.divide_factor = float(factor)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        pass  # the reference finishes all gradient work inside every backward: nothing to do

    # --- when parameters are freed and gathered ------------------------------------------------
    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        arguments.check_bool("set_reshard_after_forward", reshard_after_forward)
        for state in states_below(self, recurse):
            state.auto_reshard_after_forward = False
            if state.group is not None:
                state.group.post_forward_info = state.group.info if reshard_after_forward else None

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        for group in groups_below(self, recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        if (group := get_state(self).group) is not None:
            group.unshard_in_backward = bool(unshard_in_backward)

    def reset_iter_state(self) -> None:
        state = get_state(self)
        if state.is_root is False:
            arguments.raise_not_root("reset_iter_state", self)
        for s in state.all_states or [state]:
            s.reset()

    # --- communication hooks (called once per parameter in the reference) ------------------------
    def set_custom_all_gather(self, comm) -> None:
        if (group := get_state(self).group) is not None:
            group.comms.all_gather = comm

    def set_custom_reduce_scatter(self, comm) -> None:
        if (group := get_state(self).group) is not None:
            group.comms.reduce_scatter = comm

    def set_all_reduce_hook(self, hook, *, stream=None) -> None:
        if (group := get_state(self).group) is not None:
            arguments.check_hook_stream(stream, hsdp=group.info.replicate_group is not None)
            group.comms.all_reduce_hook = hook

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        group = get_state(self).group  # as torch's: a custom collective allocates its buffers
        arguments.check_no_custom_comms(group.comms if group is not None else None)
        super().set_allocate_memory_from_process_group_for_comm(enable)

    # --- torch's FSDP2 and nn.Module --------------------------------------------------------------
    def _get_fsdp_state(self):
        """What torch's ``register_fsdp_forward_method`` asks for: the hooks of this module."""
        return TorchStateView(get_state(self))

    def _apply(self, *args, **kwargs):
        # ``to``, ``to_empty``, ``float``...: convert the sharded parameters, registered again
        # first; they are adopted at the next unshard (ShardedParam.refresh).
        self.reshard()
        return nn.Module._apply(self, *args, **kwargs)

    def __deepcopy__(self, memo):
        arguments.raise_deepcopy(self)


class TorchStateView:
    """The two methods of torch's FSDP state that torch's ``register_fsdp_forward_method``
    calls, answered by ours."""

    def __init__(self, state: FSDPState):
        self._pre_forward = state.pre_forward  # (module, args, kwargs) -> (args, kwargs)
        self._post_forward = state.post_forward  # (module, args, output) -> output


def share_comm_ctx(modules: list) -> None:
    """Let several roots (pipeline stages) share one communication context. The reference
    has one stream and no context to share: the modules are checked, nothing else."""
    for m in modules:
        if get_state(m) is None:
            arguments.raise_not_sharded("share_comm_ctx", m)


def make_fsdp_modules(modules: list[nn.Module], *, managed, methods, group, device) -> None:
    """Give ``modules`` (holding their state already) the class with ``methods``
    (``FSDPModule``) and what a sharded module owes the rest of torch: its buffers (not
    sharded) on the compute ``device``; ``state_dict`` and ``load_state_dict`` on the sharded
    parameters, so resharded first; the marks of torch's tools (``replicate()``'s registry,
    and on every module of the call, ``managed``, the flags dynamo guards FSDP modules by)."""
    for m in modules:
        for owner in m.modules():
            for name, b in owner._buffers.items():
                if b is not None and b.device.type != "meta":
                    owner._buffers[name] = b.to(device)
    for m in group.modules_with_params() if group is not None else ():
        m.register_state_dict_pre_hook(lambda *args, **kwargs: group.reshard())
        m._register_load_state_dict_pre_hook(lambda *args, **kwargs: group.reshard())
    for m in managed:
        m._is_fsdp_managed_module = m._fsdp_use_orig_params = True
    for m in modules:
        m.__dict__.setdefault(REGISTRY_KEY, {})["fully_shard"] = RegistryItem()
        m.__class__ = fsdp_class(methods, type(m))


__all__ = ["FSDPModule", "make_fsdp_modules", "share_comm_ctx"]
