"""Second reading. ``dp_mesh_dims``: the data-parallel part of a whole SPMD mesh, by name.

``fully_shard(module, mesh=spmd_mesh, dp_mesh_dims=DataParallelMeshDims(...))`` takes the mesh
every parallelism was cut from, (``dp_shard``, ``cp``, ``tp``) say, every parameter a ``DTensor``
on it, ``Replicate`` on the dims named data parallel. The core's meshes have at most one dim to
shard over and one to replicate over, so, as torch's FSDP2: several dims of a kind are flattened
into one (``dp_shard_cp``, a process group of its own); with both kinds the replicate dim goes
first (HSDP); with replicate dims alone (DDP) the mesh is (R, 1), a shard group of one rank, so
parameters stay whole (their TP piece), gradients are all-reduced, and each parameter keeps the
user's layout. ``tp_layout`` asks ``dp_dims`` which dims a data-parallel mesh stands for.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from twinshard.api import FSDPNotSupportedError, FSDPUsageError

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
