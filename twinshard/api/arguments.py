"""What ``fully_shard`` refuses, in torch's words, for every implementation.

``fully_shard`` (``twinshard.reference.fully_shard``, whose steps the optimized path shares)
reads its arguments here before it shards anything, so that a module, a mesh or a
``reshard_after_forward`` it cannot work with is refused at once, naming what is wrong and
saying what to do, with the first words torch's ``fully_shard`` uses for the same misuse
(code written against torch keeps matching them). Nothing here is FSDP itself: the reference
reads as the algorithm, with each refusal one call.

- ``check_module``: an ``nn.Module`` with a ``forward``, not sharded already;
- ``check_mesh``: a 1D (FSDP) or 2D (HSDP) ``DeviceMesh``, a 2D one with named dims, and
  without one (``check_distributed``), a default process group to build it over;
- ``check_reshard_after_forward``: a bool, or an int dividing the shard group's size;
- ``shard_placement``: what ``shard_placement_fn`` answers for a parameter;
- ``raise_split_tie``: a parameter another ``fully_shard`` call sharded (a tie split in two);
- ``raise_ran_first``: a sharded child that ran forward before its root;
- the ``FSDPModule`` methods' refusals: ``check_divide_factor``, ``check_bool``,
  ``check_hook_stream``, ``check_no_custom_comms``, ``raise_not_root``, ``raise_not_sharded``, ``raise_deepcopy``;
- ``check_materialized``, ``check_replacement``: parameters left on meta at the first forward,
  and a parameter the user replaced (``to_empty``, ``load_state_dict(assign=True)``, DCP) by
  something that is not a ``DTensor`` of its shape;
- ``data_parallel_mesh``, ``check_spmd_params``: with ``dp_mesh_dims`` (torch 2.13's
  ``DataParallelMeshDims``), ``fully_shard`` gets the mesh every parallelism was cut from,
  (``dp_shard``, ``cp``, ``tp``) say, every parameter a ``DTensor`` on it, ``Replicate`` on
  the dims named data parallel; its data-parallel mesh is read as torch's FSDP2 reads it:
  several dims of a kind flattened into one (``dp_shard_cp``), the replicate dim first (HSDP),
  and with replicate dims alone (DDP) a mesh of (R, 1), so parameters stay whole and keep the
  user's layout. ``dp_dims`` says which dims a data-parallel mesh stands for (the reference's
  ``more/tensor_parallel.py`` places each parameter by it).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from twinshard.api import FSDPNotSupportedError, FSDPUsageError


def check_module(module: Any, state: Any) -> None:
    """Refuse what cannot be sharded: no module, a container without ``forward``, a module
    sharded already (``state``: the FSDP state it holds, or None)."""
    if not isinstance(module, nn.Module):
        raise FSDPUsageError(f"fully_shard expects an nn.Module, got {type(module).__name__}")
    if is_container_without_forward(module):
        raise FSDPUsageError(
            f"fully_shard does not support containers without forward ({type(module).__name__}); "
            "apply it to each module inside, or to the module that calls them"
        )
    if state is not None:
        raise FSDPUsageError(
            f"fully_shard was already applied to this {type(module).__name__}; "
            "apply it once per module"
        )


def check_distributed() -> None:
    """Refuse to build the default mesh before ``torch.distributed`` is initialized."""
    if not dist.is_initialized():
        raise FSDPUsageError(
            "fully_shard needs torch.distributed: call init_process_group first "
            "(twinshard.ranks.launch does it for you) or pass mesh=..."
        )


def check_mesh(mesh: Any) -> None:
    """Refuse a mesh that is not a ``DeviceMesh`` of one dim (FSDP) or two named dims (HSDP)."""
    if not isinstance(mesh, DeviceMesh):
        raise FSDPUsageError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim == 2 and not mesh.mesh_dim_names:  # as torch: which dim replicates is named
        raise FSDPUsageError(
            f"Please init the 2D mesh for HSDP with mesh_dim_names specified (fully_shard got "
            f"shape {tuple(mesh.shape)}), e.g. mesh_dim_names=('replicate', 'shard')"
        )
    if mesh.ndim > 2:
        raise FSDPUsageError(
            f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh!r} ({mesh.ndim}D); pass "
            "its data-parallel part (1D: FSDP, 2D: HSDP), e.g. mesh['dp'], or name it with "
            "dp_mesh_dims"
        )


def check_reshard_after_forward(value: Any, shard_size: int) -> None:
    """Refuse a ``reshard_after_forward`` that is not a bool or a divisor of ``shard_size``."""
    if not isinstance(value, (bool, int)):
        raise FSDPUsageError(
            f"reshard_after_forward must be a bool or an int (a group size), got {value!r}"
        )
    if not isinstance(value, bool) and (value < 1 or shard_size % value != 0):
        raise FSDPUsageError(
            f"reshard_after_forward={value} must divide the shard group size {shard_size} "
            f"(a group size to reshard to); use True, False or a divisor"
        )


def raise_split_tie(module: nn.Module, fqn: str, p: nn.Parameter) -> None:
    """Refuse a parameter of ``module`` that another ``fully_shard`` call already sharded."""
    owner = p._twinshard_sharded_by
    where = next((n for n, m in module.named_modules() if id(m) == owner), None)
    where = f"'{where}'" if where is not None else "a module outside this one"
    raise FSDPUsageError(
        f"parameter '{fqn}' of this {type(module).__name__} is the same tensor as a parameter "
        f"of {where}, which fully_shard already sharded as its own "
        "group; a parameter shared by two modules (tied weights) must be in one group: apply "
        "fully_shard to a module that holds both (and not to either one alone), or untie them"
    )


def raise_ran_first(name: str, child: nn.Module, root: nn.Module) -> None:
    """Refuse a root whose sharded child ``name`` already ran forward as a root of its own."""
    raise FSDPUsageError(
        f"'{name}' ({type(child).__name__}) already ran forward on its own, before its parent "
        f"{type(root).__name__}; run forward through the root module first so it can take "
        "charge of its children"
    )


def check_replacement(fqn: str, shape: tuple, current: Any) -> None:
    """Refuse what the module holds for parameter ``fqn`` (of global ``shape``) in place of its
    sharded ``DTensor``: anything but a ``DTensor`` of that shape, or one still on meta."""
    if not isinstance(current, DTensor) or current.shape != shape:
        raise FSDPUsageError(
            f"parameter '{fqn}' was replaced by a {type(current).__name__} of shape "
            f"{tuple(current.shape)} outside fully_shard; load values with "
            "load_state_dict or copy_ into the existing DTensor instead"
        )
    if current.is_meta:
        raise FSDPUsageError(
            f"parameter '{fqn}' is still on the meta device; materialize it first, "
            "e.g. model.to_empty(device=...) and then initialize or load the weights"
        )


def on_meta(p: Any) -> bool:
    """Whether what the module of ``p`` (a ``ShardedParam``) holds is on the meta device."""
    return p.held.is_meta


def check_materialized(states: list) -> None:
    """Refuse parameters still on the meta device in the ``FSDPState``s of a root, naming
    those of the first group that has any, as torch's ``fully_shard`` does (its tests match
    the words), and counting the others."""
    groups = [s.group.params for s in states if s.group is not None]
    meta = [[p.fqn for p in params if on_meta(p)] for params in groups]
    meta = [names for names in meta if names]
    if meta:
        others = sum(map(len, meta[1:]))
        raise FSDPUsageError(
            "FSDP parameters should be materialized from meta device before training, but "
            f"the following were still on meta device: {meta[0]}"
            + (f" (and {others} more in other groups)" if others else "")
            + "; materialize them first, e.g. model.to_empty(device=...), then initialize "
            "or load the weights"
        )


def is_container_without_forward(module: nn.Module) -> bool:
    """``ModuleList``/``ModuleDict`` hold modules but cannot be called (unless a subclass
    defines ``forward``)."""
    containers = (nn.ModuleList, nn.ModuleDict)
    return isinstance(module, containers) and any(
        type(module).forward is c.forward for c in containers if isinstance(module, c)
    )


# --- what shard_placement_fn answers -------------------------------------------------------------
# ``fully_shard(module, shard_placement_fn=fn)`` asks ``fn(param)`` once per parameter. As in
# torch 2.13's FSDP2 the answer is ``None`` (cut along dim 0 over the mesh given to
# ``fully_shard``), ``Shard(dim)`` (along ``dim``, over that mesh) or
# ``ShardPlacementResult(placement, mesh_info)``: along ``placement`` (``None``: dim 0) over a
# mesh of the parameter's own, ``mesh_info.mesh``. A mixture-of-experts block shards its experts
# over the expert-data-parallel ranks so, and its router and shared layers over the whole
# data-parallel mesh: one group, each parameter's collectives on its own mesh. ``mesh_info`` is
# torch's ``FSDPMeshInfo`` (``shard_mesh_dim=0`` on a 1D mesh) or ``HSDPMeshInfo``
# (``replicate_mesh_dim=0, shard_mesh_dim=1`` on a 2D one): anything with those three fields.


def shard_placement(shard_placement_fn, p: nn.Parameter, where: list) -> tuple[int, Any]:
    """The dim to cut ``p`` along and the ``DeviceMesh`` of its own (None: ``fully_shard``'s),
    from ``shard_placement_fn(p)``; ``where`` names ``p``'s (module, attribute) holders."""
    answer = shard_placement_fn(p) if shard_placement_fn is not None else None
    mesh = None
    if answer is not None and hasattr(answer, "mesh_info"):  # a ShardPlacementResult
        answer, mesh = answer.placement, _own_mesh(answer.mesh_info, where, p)
    name, owner = where[0][1], type(where[0][0]).__name__
    if answer is None and p.dim() == 0:
        raise FSDPUsageError(
            f"fully_shard cannot shard the 0-dim parameter of {owner}. "
            f"Change {name} to a 1D tensor with numel equal to 1 or ignore it"
        )
    if answer is None:
        return 0, mesh
    if isinstance(answer, Shard) and -p.dim() <= answer.dim < p.dim():
        return answer.dim % p.dim(), mesh
    raise FSDPUsageError(  # the first words are torch's
        f"Shard dim {getattr(answer, 'dim', answer)} is invalid for {p.dim()}D tensor: "
        f"shard_placement_fn returned {answer!r} for parameter '{name}' of {owner} "
        f"(shape {tuple(p.shape)}); return Shard(dim), None or ShardPlacementResult"
    )


def _own_mesh(mesh_info: Any, where: list, p: nn.Parameter):
    """The mesh of a ``ShardPlacementResult``'s ``mesh_info``: a 1D mesh it shards over, or a
    2D (replicate, shard) mesh for HSDP; anything else is refused, naming the parameter."""
    mesh = getattr(mesh_info, "mesh", None)
    shard = getattr(mesh_info, "shard_mesh_dim", None)
    replicate = getattr(mesh_info, "replicate_mesh_dim", None)
    fsdp = mesh is not None and mesh.ndim == 1 and shard == 0 and replicate is None
    hsdp = mesh is not None and mesh.ndim == 2 and (replicate, shard) == (0, 1)
    if fsdp or hsdp:
        return mesh
    shape = tuple(mesh.shape) if mesh is not None else None
    raise FSDPUsageError(
        f"shard_placement_fn returned a ShardPlacementResult for parameter '{where[0][1]}' of "
        f"{type(where[0][0]).__name__} (shape {tuple(p.shape)}) whose mesh_info has mesh shape "
        f"{shape}, shard_mesh_dim={shard}, replicate_mesh_dim={replicate}; give "
        "FSDPMeshInfo(mesh, shard_mesh_dim=0) of a 1D mesh, or HSDPMeshInfo(mesh, "
        "shard_mesh_dim=1, replicate_mesh_dim=0) of a 2D one"
    )


def check_divide_factor(factor: float) -> None:
    """``set_gradient_divide_factor``: a positive factor."""
    if not factor > 0:
        raise FSDPUsageError(f"gradient divide factor must be positive, got {factor!r}")


def check_bool(method: str, value: Any) -> None:
    """A setting that takes a bool (``set_reshard_after_forward``): refuse anything else."""
    if not isinstance(value, bool):
        raise FSDPUsageError(f"{method} takes a bool, got {value!r}")


def raise_not_root(method: str, module: nn.Module) -> None:
    """``method`` (``reset_iter_state``) was called on a module inside another sharded one."""
    raise FSDPUsageError(
        f"{method} must be called on the root module, not on this "
        f"{type(module).__name__}, which runs inside another sharded module"
    )


def raise_not_sharded(method: str, module: Any) -> None:
    """``method`` (``share_comm_ctx``) was given a module ``fully_shard`` never sharded."""
    raise FSDPUsageError(
        f"{method} expects modules that fully_shard was applied to; "
        f"{type(module).__name__} is not one"
    )


def check_hook_stream(stream: Any, hsdp: bool) -> None:
    """``set_all_reduce_hook``: a stream of its own only without HSDP, as torch's."""
    if stream is not None and hsdp:
        raise FSDPUsageError("set_all_reduce_hook: stream cannot be set with HSDP")


def check_no_custom_comms(comms: Any) -> None:
    """``set_allocate_memory_from_process_group_for_comm``, as torch's: not beside a custom
    collective (``comms``: the group's ``CommHooks``, or None), which allocates its buffers."""
    if comms is not None and (comms.all_gather or comms.reduce_scatter):
        raise FSDPUsageError(
            "set_allocate_memory_from_process_group_for_comm cannot be used with a custom "
            "all-gather or reduce-scatter (set_custom_*), which allocates its own buffers"
        )


def raise_deepcopy(module: nn.Module) -> None:
    """A sharded module cannot be deep-copied: its parameters are split over ranks."""
    raise FSDPUsageError(
        f"cannot deepcopy the sharded {type(module).__name__}: its parameters are split over "
        "ranks; copy the unsharded model before fully_shard, or use its state_dict"
    )


_made: dict[int, tuple] = {}  # id(data-parallel mesh) -> (it, replicate names, shard names)


def data_parallel_mesh(mesh: DeviceMesh, dp_mesh_dims, reshard_after_forward) -> DeviceMesh:
    """The data-parallel mesh of a whole SPMD ``mesh``: (shard), (replicate, shard) or
    (replicate, 1), each of the dims ``dp_mesh_dims`` names of a kind flattened into one. An int
    ``reshard_after_forward`` is refused, as torch's FSDP2 refuses it (rows of N ranks of a mesh
    that is a part of the world are not built alike on every rank)."""
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise FSDPNotSupportedError(
            f"reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims): "
            f"fully_shard got {reshard_after_forward}; pass True or False"
        )
    shard, replicate = dp_mesh_dims.shard_names, dp_mesh_dims.replicate_names
    missing = [n for n in (*shard, *replicate) if n not in (mesh.mesh_dim_names or ())]
    if missing:
        raise FSDPUsageError(
            f"dp_mesh_dims={dp_mesh_dims} names {missing}, which the mesh passed to fully_shard "
            f"lacks (its dims: {mesh.mesh_dim_names}); pass the whole SPMD mesh, dims named"
        )
    one = lambda names: mesh[names] if len(names) == 1 else mesh[names]._flatten()  # noqa: E731
    if not shard:  # unflattened as torch's meshes are: every copy of it, on every rank, at once
        dp = one(replicate)._unflatten(0, (one(replicate).size(), 1), ("_".join(replicate), "1"))
    elif not replicate:
        dp = one(shard)
    elif len(shard) == len(replicate) == 1:
        dp = mesh[(*replicate, *shard)]
    else:
        dp = DeviceMesh._concatenate([one(replicate), one(shard)])
    _made[id(dp)] = (dp, replicate, shard)
    return dp


def dp_dims(dp_mesh: DeviceMesh) -> tuple[tuple, tuple, bool]:
    """(replicate names, shard names, replicate only) of the dims of the whole mesh that
    ``dp_mesh`` stands for: as ``dp_mesh_dims`` named them, else ``dp_mesh``'s own dims."""
    made = _made.get(id(dp_mesh))
    if made is not None and made[0] is dp_mesh:
        return made[1], made[2], not made[2]
    names = tuple(dp_mesh.mesh_dim_names or ())
    return names[:-1], names[-1:], False


def check_spmd_params(owners: dict) -> None:
    """With ``dp_mesh_dims``, refuse a parameter that is not a ``DTensor`` (of the whole mesh);
    ``owners`` maps each parameter to the (module, name) pairs holding it."""
    plain = [where[0][1] for p, where in owners.items() if not isinstance(p, DTensor)]
    if plain:  # the first words are torch's
        raise FSDPUsageError(
            "When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh "
            f"(e.g. via distribute_module). Got plain tensor for parameter '{plain[0]}'. Make "
            "each a DTensor on that mesh, or pass the data-parallel mesh and no dp_mesh_dims"
        )
