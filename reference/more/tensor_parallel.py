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

A parameter on the whole SPMD mesh (``dp_mesh_dims``, ``spmd_dims.py``) is unsharded on that
mesh, as torch's is; with dp dims only (torchtitan's ``full_dtensor``) its local tensor is the
whole parameter. ``TPLayout`` holds what a parameter needs; ``tp_layout`` finds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from twinshard.api import FSDPUsageError

from .spmd_dims import dp_dims


@dataclass
class TPLayout:
    mesh: DeviceMesh  # the parameter's own: the unsharded parameter lives (and computes) here
    placements: tuple  # its placements there
    tp_placements: tuple  # those of its TP dims (none: a whole-mesh parameter, dp dims only)
    spmd_mesh: DeviceMesh  # (dp..., tp...): where the sharded parameter lives
    shape: torch.Size  # the whole (global) parameter
    stride: tuple
    keeps_layout: bool = False  # replicate-only dp_mesh_dims: sharded is its own layout

    def sharded_placements(self, info, dim: int) -> tuple:
        """Placements of the sharded parameter on the spmd mesh, FSDP cutting ``dim``."""
        cut_by_tp = any(isinstance(p, Shard) and p.dim == dim for p in self.tp_placements)
        tp_size = self.spmd_mesh.size() // info.mesh.size()
        fsdp = _StridedShard(dim, split_factor=tp_size) if cut_by_tp else Shard(dim)
        # the dims before FSDP's replicate (HSDP's one, or each dp_mesh_dims names)
        replicate = (Replicate(),) * (self.spmd_mesh.ndim - len(self.tp_placements) - 1)
        return (*replicate, fsdp, *self.tp_placements)

    def sharded_spec(self, info, dim: int) -> tuple:
        """Where the sharded parameter lives: the spmd mesh, its placements there (FSDP cutting
        ``dim`` over the ranks of ``info``, a ``MeshInfo``), the whole parameter's stride."""
        if self.keeps_layout:  # nothing sharded: the parameter's own layout
            return self.mesh, self.placements, self.stride
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
    replicated, sharded, replicate_only = dp_dims(info.mesh)
    dp_names = (*replicated, *sharded)
    names = tuple(mesh.mesh_dim_names or ())
    if any(name in names for name in dp_names):  # on the whole mesh: drop its dp dims
        keep = [i for i, name in enumerate(names) if name not in dp_names]
        if any(not placements[i].is_replicate() for i, n in enumerate(names) if n in dp_names):
            raise FSDPUsageError(f"parameter '{where}' must be replicated on the dp mesh dims")
        placements = tuple(placements[i] for i in keep)
        mesh = mesh[tuple(names[i] for i in keep)] if keep else None  # None: dp dims only
    if any(not isinstance(p, (Shard, Replicate)) for p in placements):
        raise FSDPUsageError(f"parameter '{where}': TP placements {placements} unsupported")
    # DDP: the parameter keeps its layout
    spmd = param.device_mesh if replicate_only else spmd_mesh(info.mesh, mesh, dp_names)
    if spmd is None:
        raise FSDPUsageError(
            f"parameter '{where}' is a DTensor on a mesh not cut from the fully_shard mesh's "
            f"parent after its dims {dp_names}; build one named mesh (dp, tp or pp, dp, tp, say), "
            "pass mesh['tp'] to parallelize_module and mesh['dp'] to fully_shard"
        )
    return TPLayout(*own, placements, spmd, param.shape, param.stride(), replicate_only)


def spmd_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh | None, dp_names: tuple):
    """Where a sharded parameter lives, as torch's puts it: the root's dp dims (``dp_names``, for
    which ``dp_mesh`` stands), then the tp dims (``tp_mesh``, or None), if they are the root's
    in that order (equal meshes, not only identical); None otherwise. Flattened shard dims stay
    the dp mesh's one dim, the tp dims beside it."""
    if tp_mesh is None and tuple(dp_names) == tuple(dp_mesh.mesh_dim_names or ()):
        return dp_mesh  # dp dims only, as fully_shard's mesh has them
    unnamed = (None,)  # a dim without a name cannot be found in the root
    tp_names = () if tp_mesh is None else tp_mesh.mesh_dim_names or unnamed
    root, names = dp_mesh._get_root_mesh(), (*(dp_names or unnamed), *tp_names)
    order = [i for n in names for i, m in enumerate(root.mesh_dim_names or ()) if m == n]
    if len(order) < len(names) or order != sorted(order):
        return None  # every dim named, in the root's order (the dp dims first)
    if tp_mesh is not None and root[tp_names] != tp_mesh:
        return None
    if len(dp_dims(dp_mesh)[1]) > 1:  # shard dims flattened (spmd_dims.py)
        return dp_mesh if tp_mesh is None else DeviceMesh._concatenate([dp_mesh, tp_mesh])
    return dp_mesh if names == tuple(dp_mesh.mesh_dim_names or ()) else root[names]
