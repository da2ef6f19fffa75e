"""Second reading. FSDP over tensor parallelism: parameters that are already ``DTensor``s.

With tensor parallelism, ``parallelize_module(model, mesh["tp"], plan)`` turns a layer's weight
into a ``DTensor`` on the ``tp`` mesh: each rank holds a TP piece (say, every other output
row). ``fully_shard(block, mesh=mesh["dp"])`` then shards that *piece* across the ``dp`` mesh,
exactly as it shards a whole parameter without TP: the TP piece plays the part of the parameter.

Two things change around it:

- the sharded parameter is a ``DTensor`` on the dp and tp dims of the mesh both were cut from
  ((``dp``, ``tp``), HSDP's (``replicate``, ``shard``, ``tp``), out of (``pp``, ``dp``, ``tp``)
  say), placed ``Replicate`` on the replicate dim, FSDP's ``Shard(dim)`` on the shard dim
  (``_StridedShard(dim)`` when TP cut the same dim: rows of each TP piece), then TP's own;
- the unsharded parameter, which the TP layers compute with, is again a ``DTensor`` on the
  ``tp`` mesh, wrapping the all-gathered piece; its gradient is one too, and FSDP reduces the
  gradient's TP piece.

A parameter on the whole SPMD mesh (``dp_mesh_dims``; ``Replicate`` on its dp dims) is unsharded
on that mesh, as torch's is. With dp dims only (torchtitan's ``full_dtensor``) its local tensor
is the whole parameter, sharded like a plain one; the sharded ``DTensor`` is on the dp mesh.

``TPLayout`` holds what a parameter needs for this; ``tp_layout`` finds it (or None: no TP).
``data_parallel_mesh`` and ``check_spmd_params`` serve ``fully_shard(..., dp_mesh_dims=...)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from twinshard.api import FSDPUsageError


@dataclass
class TPLayout:
    mesh: DeviceMesh  # the parameter's own: the unsharded parameter lives (and computes) here
    placements: tuple  # its placements there
    tp_placements: tuple  # those of its TP dims (none: a whole-mesh parameter, dp dims only)
    spmd_mesh: DeviceMesh  # (dp..., tp...): where the sharded parameter lives
    shape: torch.Size  # the whole (global) parameter
    stride: tuple

    def sharded_placements(self, info, dim: int) -> tuple:
        """Placements of the sharded parameter on the spmd mesh, FSDP cutting ``dim``."""
        cut_by_tp = any(isinstance(p, Shard) and p.dim == dim for p in self.tp_placements)
        tp_size = self.spmd_mesh.size() // info.mesh.size()
        fsdp = _StridedShard(dim, split_factor=tp_size) if cut_by_tp else Shard(dim)
        replicate = (Replicate(),) if info.replicate_group is not None else ()
        return (*replicate, fsdp, *self.tp_placements)

    def sharded_spec(self, info, dim: int) -> tuple:
        """Where the sharded parameter lives: the spmd mesh, its placements there (FSDP cutting
        ``dim`` over the ranks of ``info``, a ``MeshInfo``), the whole parameter's stride."""
        return self.spmd_mesh, self.sharded_placements(info, dim), self.stride

    def unsharded(self, piece: torch.Tensor) -> DTensor:
        """The gathered TP piece as the DTensor the layers expect."""
        return DTensor.from_local(
            piece, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )


def tp_layout(param: DTensor, info, where: str) -> TPLayout:
    """The TP layout of ``param``, a DTensor (tensor parallelism, or the whole SPMD mesh),
    sharded over ``info`` (a ``MeshInfo``)."""
    own = mesh, placements = param.device_mesh, tuple(param.placements)  # own: the unsharded's
    dp_names = tuple(info.mesh.mesh_dim_names or ())
    names = tuple(mesh.mesh_dim_names or ())
    if any(name in names for name in dp_names):  # on the whole mesh: drop its dp dims
        keep = [i for i, name in enumerate(names) if name not in dp_names]
        if any(not placements[i].is_replicate() for i, n in enumerate(names) if n in dp_names):
            raise FSDPUsageError(f"parameter '{where}' must be replicated on the dp mesh dims")
        placements = tuple(placements[i] for i in keep)
        mesh = mesh[tuple(names[i] for i in keep)] if keep else None  # None: dp dims only
    if any(not isinstance(p, (Shard, Replicate)) for p in placements):
        raise FSDPUsageError(f"parameter '{where}': TP placements {placements} unsupported")
    spmd = spmd_mesh(info.mesh, mesh) if mesh is not None else info.mesh
    if spmd is None:
        raise FSDPUsageError(
            f"parameter '{where}' is a DTensor on a mesh not cut from the fully_shard mesh's "
            f"parent after its dims {dp_names}; build one named mesh (dp, tp or pp, dp, tp, say), "
            "pass mesh['tp'] to parallelize_module and mesh['dp'] to fully_shard"
        )
    return TPLayout(*own, placements, spmd, param.shape, param.stride())


def spmd_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh | None:
    """The mesh of the dp dims and then the tp dims, cut from the dp mesh's root, when the tp
    mesh is (equal to) that root's tp dims; None otherwise. Equal, not identical: a mesh built
    twice, or a slice torch hands out again from an earlier mesh, is the same mesh."""
    unnamed = (None,)  # a dim without a name cannot be found in the root
    dp_names, tp_names = dp_mesh.mesh_dim_names or unnamed, tp_mesh.mesh_dim_names or unnamed
    root, names = dp_mesh._get_root_mesh(), (*dp_names, *tp_names)
    order = [i for n in names for i, m in enumerate(root.mesh_dim_names or ()) if m == n]
    if len(order) < len(names) or order != sorted(order) or root[tp_names] != tp_mesh:
        return None  # every dim named, in the root's order (the dp dims first)
    return root[names]


def data_parallel_mesh(mesh: DeviceMesh, dp_mesh_dims) -> DeviceMesh:
    """The part of a whole SPMD ``mesh`` that ``dp_mesh_dims`` names: its ``shard`` dim (FSDP),
    with its ``replicate`` dim in front (HSDP). One name each: flattening several is not
    supported."""
    shard, replicate = dp_mesh_dims.shard_names, dp_mesh_dims.replicate_names
    if len(shard) != 1 or len(replicate) > 1:
        raise FSDPUsageError(
            f"dp_mesh_dims={dp_mesh_dims}: twinshard takes one shard dim name and at most one "
            "replicate dim name (several dims flattened into one are not supported)"
        )
    return mesh[(*replicate, *shard)]


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
