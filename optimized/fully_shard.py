"""``fully_shard`` of the optimized implementation.

The same steps as ``twinshard.reference.fully_shard`` (collect, shard, attach hooks, change
the class), reusing its checks and its sharded parameters; what differs is the group
(``FlatParamGroup``: one collective per group, asynchronous) and the hooks (``FSDPState``:
prefetch). The FSDPModule methods are the reference's, plus real prefetch lists and a real
asynchronous ``unshard``.
"""

from __future__ import annotations

import functools
import weakref

import torch.nn as nn

from twinshard.api import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, UnshardHandle,
                           as_mp_policy, as_offload_policy, _check_fsdp_modules, FSDPUsageError)
from twinshard.reference.fully_shard import (FSDPModule as ReferenceModule, _check_module,
                                             _collect_params)
from twinshard.reference.mesh import default_mesh, mesh_info, post_forward_mesh_info
from twinshard.reference.sharded_param import ShardedParam
from twinshard.reference.state import get_state

from .flat_group import FlatParamGroup
from .state import FSDPState


def fully_shard(module: nn.Module, *, mesh=None, reshard_after_forward: bool | int | None = None,
                mp_policy=MixedPrecisionPolicy(), offload_policy=OffloadPolicy(),
                ignored_params: set[nn.Parameter] | None = None,
                shard_placement_fn=None) -> nn.Module:
    """Shard ``module`` like ``twinshard.reference.fully_shard``, communicating per group and
    overlapping communication with compute."""
    _check_module(module)
    if shard_placement_fn is not None:
        raise FSDPUsageError("twinshard.optimized shards every parameter on dim 0; "
                             "shard_placement_fn is not supported")
    info = mesh_info(mesh if mesh is not None else default_mesh())
    auto = reshard_after_forward is None
    post_forward = post_forward_mesh_info(True if auto else reshard_after_forward, info)
    mp, offload = as_mp_policy(mp_policy), as_offload_policy(offload_policy)
    cpu_offload = offload if isinstance(offload, CPUOffloadPolicy) else None
    owners = _collect_params(module, set(ignored_params or ()))
    params = [ShardedParam(p, where, info, info.device, cpu_offload) for p, where in owners.items()]
    for p, sp in zip(owners, params):
        p._twinshard_owner = sp.sharded_param._twinshard_owner = weakref.ref(module)
    for buffer_owner in module.modules():
        for name, b in buffer_owner._buffers.items():
            if b is not None and b.device.type != "meta":
                buffer_owner._buffers[name] = b.to(info.device)
    group = FlatParamGroup(params, info, post_forward, mp, info.device) if params else None
    state = FSDPState(module, group, mp, auto)
    module.__dict__["_twinshard_state"] = state
    if group is not None:
        for m in group.named_modules_with_params():
            m.register_state_dict_pre_hook(lambda *args, **kwargs: group.reshard())
            m._register_load_state_dict_pre_hook(lambda *args, **kwargs: group.reshard())
    module.__class__ = _fsdp_class(type(module))
    return module


class _Handle(UnshardHandle):
    def __init__(self, group: FlatParamGroup):
        self.group = group

    def wait(self) -> None:
        self.group.wait_for_unshard()


class FSDPModule(ReferenceModule):
    """The reference's methods, with an asynchronous ``unshard`` and real prefetch lists."""

    def _fsdp_unshard(self, wait: bool):
        state = get_state(self)
        state.lazy_init()
        if state.group is None:
            return None if wait else UnshardHandle()
        state.group.unshard_async()
        if wait:
            state.group.wait_for_unshard()
            return None
        return _Handle(state.group)

    def set_modules_to_forward_prefetch(self, modules) -> None:
        get_state(self).forward_hint = _check_fsdp_modules(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules) -> None:
        get_state(self).backward_hint = _check_fsdp_modules(modules, "set_modules_to_backward_prefetch")

    def set_post_optim_event(self, event) -> None:
        state = get_state(self)
        state.lazy_init()
        state.comm.post_optim_event = event


@functools.cache
def _fsdp_class(cls: type) -> type:
    return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    from twinshard.reference.fully_shard import register_fsdp_forward_method as register
    register(module, method_name)
