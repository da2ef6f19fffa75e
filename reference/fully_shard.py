"""``fully_shard``: turn a module (or a list of modules) into one FSDP parameter group.

Apply it bottom-up: to each transformer block, then to the root. Each call

1. collects the parameters of the module that no sharded child already manages (a parameter
   shared by several modules, such as tied weights, is collected once),
2. shards each one (``ShardedParam``): rank r keeps row-block r as a ``DTensor``,
3. attaches an ``FSDPState`` whose hooks unshard, reshard and reduce (``state.py``),
4. makes the module an ``FSDPModule`` too (``twinshard.api.FSDPModule`` documents its methods).

A list of modules (``fully_shard([norm, head])``) makes one group of all their parameters,
gathered when the first of them starts forward, freed when the last one has finished.
"""

from __future__ import annotations

from typing import NamedTuple

import torch.nn as nn

import twinshard.api.arguments as arguments
from twinshard.api import MixedPrecisionPolicy, OffloadPolicy, as_mp_policy, as_offload_policy

from . import more
from .mesh import default_mesh, mesh_info
from .more.fsdp_module import FSDPModule, make_fsdp_modules
from .param_group import ParamGroup
from .sharded_param import ShardedParam
from .state import FSDPState, get_state


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh=None,
    reshard_after_forward: bool | int | None = None,
    mp_policy=MixedPrecisionPolicy(),
    offload_policy=OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    shard_placement_fn=None,
    dp_mesh_dims=None,
) -> nn.Module:
    """Shard ``module``'s parameters across ``mesh`` (1D: FSDP, 2D: HSDP); returns the module
    (or the list of modules, sharded as one group).

    ``reshard_after_forward``: ``True`` frees the parameters after forward and all-gathers
    them again in backward; ``False`` keeps them until after backward; an int N keeps a 1/N
    piece; ``None`` (default) means ``True``, except for the root, which keeps them.
    """
    impl = Implementation(ParamGroup, FSDPState, FSDPModule)  # the reference's three
    return shard_module(
        module,
        impl,
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params=ignored_params,
        shard_placement_fn=shard_placement_fn,
        dp_mesh_dims=dp_mesh_dims,
    )


class Implementation(NamedTuple):
    """The types that make an implementation: a ``ParamGroup`` schedules one group's
    collectives, an ``FSDPState`` holds the hooks, an ``FSDPModule`` adds the methods."""

    group_type: type
    state_type: type
    module_type: type


def shard_module(
    module,
    impl: Implementation,
    *,
    mesh,
    reshard_after_forward,
    mp_policy,
    offload_policy,
    ignored_params,
    shard_placement_fn,
    dp_mesh_dims=None,
) -> nn.Module:
    """The steps of ``fully_shard`` for ``impl``'s types (the contract: docs/optimized-path.md)."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    for m in modules:
        arguments.check_module(m, get_state(m))  # an nn.Module with a forward, sharded once
    mesh = mesh if mesh is not None else default_mesh()
    if dp_mesh_dims is not None:  # ``mesh`` is the whole SPMD mesh: take its data-parallel part
        mesh = arguments.data_parallel_mesh(mesh, dp_mesh_dims, reshard_after_forward)
    info = mesh_info(mesh)
    auto = reshard_after_forward is None
    # what backward gathers over: the shard group, None (kept unsharded) or rows of N ranks
    post_forward = more.post_forward_mesh_info(True if auto else reshard_after_forward, info)
    mp, offload = as_mp_policy(mp_policy), as_offload_policy(offload_policy)
    owners, managed = _collect_params(modules, set(ignored_params or ()))
    if dp_mesh_dims is not None:
        arguments.check_spmd_params(owners)  # each a DTensor of the whole SPMD mesh
    params, meshes = [], {mesh: info}  # a parameter may have a mesh of its own (experts')
    for p, where in owners.items():
        dim, own = arguments.shard_placement(shard_placement_fn, p, where)  # Shard(dim), mesh
        p_info = meshes.setdefault(own, mesh_info(own)) if own is not None else info
        layout = more.choose_layout(
            p, info=p_info, device=info.device, dim=dim, offload=offload, mp=mp, fqn=where[0][1]
        )
        params.append(ShardedParam(p, where, p_info, layout))
    for p in owners:  # the original tensor: a tie elsewhere still holds it (_collect_params)
        p._twinshard_sharded_by = id(modules[0])  # an int: the tensor stays picklable
    group = impl.group_type(params, info, post_forward, mp) if params else None
    state = impl.state_type(modules, group, mp, auto)
    for m in modules:
        m.__dict__["_twinshard_state"] = state
    # FSDP<Name>: buffers on the compute device, state_dict() resharded first, torch's marks
    make_fsdp_modules(
        modules, managed=managed, methods=impl.module_type, group=group, device=info.device
    )
    return module


def _collect_params(modules: list[nn.Module], ignored: set) -> tuple[dict, list]:
    """Map each parameter this call manages to every (module, attribute) holding it, in
    torch's order (a module's own after its children's: a custom collective's message is
    laid out so); also return the modules visited (those this call manages).

    Sharded children are skipped: their parameters are theirs. A parameter that a child
    already sharded but that also sits elsewhere in this subtree is a tie split across two
    groups, which cannot work: each group would hold its own copy.
    """
    todo, visited = [("", module) for module in modules], []
    while todo:  # each module before its children, the last child first; reversed below
        prefix, m = todo.pop()
        visited.append((prefix, m))
        todo += [(f"{prefix}{n}.", c) for n, c in m.named_children() if get_state(c) is None]
    owners: dict[nn.Parameter, list] = {}
    for prefix, m in reversed(visited):
        for name, p in m._parameters.items():
            if p is not None and p not in ignored:
                if hasattr(p, "_twinshard_sharded_by"):
                    arguments.raise_split_tie(modules[0], prefix + name, p)
                owners.setdefault(p, []).append((m, name))
    return owners, [m for _, m in visited]
