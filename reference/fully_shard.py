"""``fully_shard``: turn a module into one FSDP parameter group.

Apply it bottom-up: to each transformer block, then to the root. Each call

1. collects the parameters of the module that no sharded child already manages (a parameter
   shared by several modules, such as tied weights, is collected once),
2. shards each one (``ShardedParam``): rank r keeps row-block r as a ``DTensor``,
3. attaches an ``FSDPState`` whose hooks unshard, reshard and reduce (``state.py``),
4. changes the module's class so that it also is an ``FSDPModule``, with the methods of the
   interface (``twinshard.api.FSDPModule`` documents each one).
"""

from __future__ import annotations

import functools
import weakref

import torch.nn as nn

from twinshard.api import (
    CPUOffloadPolicy,
    FSDPUsageError,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
    as_mp_policy,
    as_offload_policy,
    is_container_without_forward,
)
from twinshard.api import (
    FSDPModule as FSDPModuleContract,
)

from .mesh import default_mesh, mesh_info, post_forward_mesh_info
from .param_group import ParamGroup
from .sharded_param import ShardedParam
from .state import FSDPState, get_state


def fully_shard(
    module: nn.Module,
    *,
    mesh=None,
    reshard_after_forward: bool | int | None = None,
    mp_policy=MixedPrecisionPolicy(),
    offload_policy=OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    shard_placement_fn=None,
) -> nn.Module:
    """Shard ``module``'s parameters across ``mesh`` (1D: FSDP, 2D: HSDP); returns the module.

    ``reshard_after_forward``: ``True`` frees the parameters after forward and all-gathers
    them again in backward; ``False`` keeps them until after backward; an int N keeps a 1/N
    piece; ``None`` (default) means ``True``, except for the root, which keeps them.
    """
    return shard_module(
        module,
        ParamGroup,
        FSDPState,
        FSDPModule,
        mesh,
        reshard_after_forward,
        mp_policy,
        offload_policy,
        ignored_params,
        shard_placement_fn,
    )


def shard_module(
    module,
    group_type,
    state_type,
    module_type,
    mesh,
    reshard_after_forward,
    mp_policy,
    offload_policy,
    ignored_params,
    shard_placement_fn,
) -> nn.Module:
    """The steps of ``fully_shard``, given the three types that make an implementation.

    ``group_type`` (a ``ParamGroup`` subclass) schedules the collectives of one group's
    parameters, ``state_type`` (an ``FSDPState`` subclass) holds the hooks, and ``module_type``
    (an ``FSDPModule`` subclass) adds the methods. ``twinshard.optimized`` calls this with its
    own three types; together with ``ShardedParam``'s public methods it is the contract
    between the two implementations."""
    _check_module(module)
    if shard_placement_fn is not None:
        raise FSDPUsageError(
            "twinshard shards every parameter on dim 0; shard_placement_fn is not supported"
        )
    info = mesh_info(mesh if mesh is not None else default_mesh())
    auto = reshard_after_forward is None
    post_forward = post_forward_mesh_info(True if auto else reshard_after_forward, info)
    mp, offload = as_mp_policy(mp_policy), as_offload_policy(offload_policy)
    device = info.device
    owners = _collect_params(module, set(ignored_params or ()))
    cpu_offload = offload if isinstance(offload, CPUOffloadPolicy) else None
    params = [ShardedParam(p, where, info, device, cpu_offload) for p, where in owners.items()]
    for p, sp in zip(owners, params):
        p._twinshard_owner = sp.sharded_param._twinshard_owner = weakref.ref(module)
    for buffer_owner in module.modules():  # buffers are not sharded; they follow the device
        for name, b in buffer_owner._buffers.items():
            if b is not None and b.device.type != "meta":
                buffer_owner._buffers[name] = b.to(device)
    group = group_type(params, info, post_forward, mp, device) if params else None
    state = state_type(module, group, mp, auto)
    module.__dict__["_twinshard_state"] = state
    if group is not None:
        for m in group.modules_with_params():
            m.register_state_dict_pre_hook(lambda *args, **kwargs: group.reshard())
            m._register_load_state_dict_pre_hook(lambda *args, **kwargs: group.reshard())
    module.__class__ = _fsdp_class(module_type, type(module))
    return module


def _check_module(module: nn.Module) -> None:
    if isinstance(module, (list, tuple)):
        raise FSDPUsageError(
            "the reference takes one module per fully_shard call; "
            "wrap the modules in a parent module and shard that"
        )
    if not isinstance(module, nn.Module):
        raise FSDPUsageError(f"fully_shard expects an nn.Module, got {type(module).__name__}")
    if is_container_without_forward(module):
        raise FSDPUsageError(
            f"fully_shard does not support containers without forward ({type(module).__name__}); "
            "apply it to each module inside, or to the module that calls them"
        )
    if get_state(module) is not None:
        raise FSDPUsageError(
            f"fully_shard was already applied to this {type(module).__name__}; "
            "apply it once per module"
        )


def _collect_params(module: nn.Module, ignored: set) -> dict[nn.Parameter, list]:
    """Map each parameter this call manages to every (module, attribute) holding it.

    Sharded children are skipped: their parameters are theirs. A parameter that a child
    already sharded but that also sits elsewhere in this subtree is a tie split across two
    groups, which cannot work: each group would hold its own copy.
    """
    owners: dict[nn.Parameter, list] = {}
    todo = [("", module)]
    while todo:
        prefix, m = todo.pop(0)
        for name, p in m._parameters.items():
            if p is None or p in ignored:
                continue
            if hasattr(p, "_twinshard_owner"):
                _raise_split_tie(module, prefix + name, p)
            owners.setdefault(p, []).append((m, name))
        for child_name, child in m._modules.items():
            if child is not None and get_state(child) is None:
                todo.append((f"{prefix}{child_name}.", child))
    return owners


def _raise_split_tie(module: nn.Module, fqn: str, p: nn.Parameter) -> None:
    other = p._twinshard_owner()
    where = next((n for n, m in module.named_modules() if m is other), None)
    if where is None:
        raise FSDPUsageError(
            f"parameter '{fqn}' is already sharded by fully_shard on a module outside "
            f"this {type(module).__name__}; apply fully_shard bottom-up, children first"
        )
    raise FSDPUsageError(
        f"parameter '{fqn}' is tied to a parameter of '{where}' ({type(other).__name__}), "
        f"which fully_shard already sharded as its own group; tied parameters must be in one "
        f"group: do not shard '{where}' separately, or untie them"
    )


# --- the FSDPModule methods ------------------------------------------------------------------------
def _states_below(module: nn.Module, recurse: bool) -> list[FSDPState]:
    modules = module.modules() if recurse else [module]
    return [s for m in modules if (s := get_state(m)) is not None]


def _groups_below(module: nn.Module, recurse: bool) -> list[ParamGroup]:
    return [s.group for s in _states_below(module, recurse) if s.group is not None]


class FSDPModule(FSDPModuleContract):
    """The reference's FSDPModule; each method is documented on ``twinshard.api.FSDPModule``."""

    def _fsdp_unshard(self, wait: bool) -> UnshardHandle | None:
        state = get_state(self)
        state.lazy_init()
        if state.group is not None:
            state.group.unshard()  # blocking: the handle below is already complete
        return None if wait else UnshardHandle()

    def reshard(self) -> None:
        if (group := get_state(self).group) is not None:
            group.reshard()

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        for group in _groups_below(self, recurse):
            group.reduce_grads = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        for group in _groups_below(self, recurse):
            group.all_reduce_grads = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise FSDPUsageError(
                f"set_reshard_after_forward takes a bool, got {reshard_after_forward!r}"
            )
        for state in _states_below(self, recurse):
            state.auto_reshard_after_forward = False
            if state.group is not None:
                state.group.post_forward_info = state.group.info if reshard_after_forward else None

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        for group in _groups_below(self, recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        # The reference finishes all gradient work inside every backward, so this only records it.
        get_state(self).is_last_backward = is_last_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        if not factor > 0:
            raise FSDPUsageError(f"gradient divide factor must be positive, got {factor!r}")
        if (group := get_state(self).group) is not None:
            group.divide_factor = float(factor)

    def __deepcopy__(self, memo):
        raise FSDPUsageError(
            f"cannot deepcopy the sharded {type(self).__name__}: its parameters are split over "
            "ranks; copy the unsharded model before fully_shard, or use its state_dict"
        )


@functools.cache
def _fsdp_class(methods: type, cls: type) -> type:
    """``FSDP<Name>``: the module's own class with the FSDPModule ``methods`` mixed in."""
    return type(f"FSDP{cls.__name__}", (methods, cls), {})


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` run the same hooks as ``module(...)`` does, so a
    method other than ``forward`` (e.g. ``generate``) sees unsharded parameters."""
    state = get_state(module)
    if state is None:
        raise FSDPUsageError(
            f"register_fsdp_forward_method: fully_shard was not applied to "
            f"this {type(module).__name__}"
        )
    method = getattr(module, method_name, None)
    if not callable(method):
        raise FSDPUsageError(f"{type(module).__name__} has no method '{method_name}'")

    @functools.wraps(method)
    def with_hooks(*args, **kwargs):
        args, kwargs = state.pre_forward(module, args, kwargs)
        return state.post_forward(module, args, method(*args, **kwargs))

    setattr(module, method_name, with_hooks)
