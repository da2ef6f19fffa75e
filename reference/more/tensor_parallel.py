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
whole parameter. The ``TensorParallel`` layout holds what a parameter needs.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from twinshard.api import FSDPUsageError

from ..layout import Layout
from .spmd_dims import dp_dims


class TensorParallel(Layout):
    """The layout of a ``DTensor`` parameter (tensor parallelism, or the whole SPMD mesh)."""

    plain = False

    def setup(self, *, param: DTensor, info, fqn: str, **_) -> None:
        """Find where the parameter lives and how FSDP's placement joins its own."""
        own = mesh, placements = param.device_mesh, tuple(param.placements)  # the unsharded's
        replicated, sharded, replicate_only = dp_dims(info.mesh)
        dp_names = (*replicated, *sharded)
        names = tuple(mesh.mesh_dim_names or ())
        if any(name in names for name in dp_names):  # on the whole mesh: drop its dp dims
            keep = [i for i, name in enumerate(names) if name not in dp_names]
            if any(not placements[i].is_replicate() for i, n in enumerate(names) if n in dp_names):
                raise FSDPUsageError(f"parameter '{fqn}' must be replicated on the dp mesh dims")
            placements = tuple(placements[i] for i in keep)
            mesh = mesh[tuple(names[i] for i in keep)] if keep else None  # None: dp dims only
        if any(not isinstance(p, (Shard, Replicate)) for p in placements):
            raise FSDPUsageError(f"parameter '{fqn}': TP placements {placements} unsupported")
        # DDP: the parameter keeps its layout
        spmd = param.device_mesh if replicate_only else spmd_mesh(info.mesh, mesh, dp_names)
        if spmd is None:
            raise FSDPUsageError(
                f"parameter '{fqn}' is a DTensor on a mesh not cut from the fully_shard mesh's "
                f"parent after its dims {dp_names}; build one named mesh (dp, tp or pp, dp, tp, "
                "say), pass mesh['tp'] to parallelize_module and mesh['dp'] to fully_shard"
            )
        self.tp_mesh, self.tp_own_placements = own  # the unsharded parameter lives here
        self.tp_placements = placements  # of its TP dims (none: a whole-mesh parameter)
        self.spmd_mesh = spmd  # (dp..., tp...): where the sharded parameter lives
        self.tp_shape, self.tp_stride = param.shape, param.stride()  # the whole parameter
        self.keeps_layout = replicate_only  # replicate-only dp_mesh_dims: sharded as it is

    def piece(self, param: DTensor) -> torch.Tensor:
        return param.to_local()  # the TP piece plays the part of the parameter

    def shard_spec(self, info, stride: tuple) -> tuple:
        """The spmd mesh, its placements there (FSDP cutting ``dim`` over the ranks of
        ``info``), the whole parameter's stride."""
        if self.keeps_layout:  # nothing sharded: the parameter's own layout
            return self.tp_mesh, self.tp_own_placements, self.tp_stride
        cut_by_tp = any(isinstance(p, Shard) and p.dim == self.dim for p in self.tp_placements)
        tp_size = self.spmd_mesh.size() // info.mesh.size()
        fsdp = _StridedShard(self.dim, split_factor=tp_size) if cut_by_tp else Shard(self.dim)
        # the dims before FSDP's replicate (HSDP's one, or each dp_mesh_dims names)
        replicate = (Replicate(),) * (self.spmd_mesh.ndim - len(self.tp_placements) - 1)
        return self.spmd_mesh, (*replicate, fsdp, *self.tp_placements), self.tp_stride

    def unsharded(self, whole: torch.Tensor) -> DTensor:
        """The gathered TP piece as the DTensor the layers expect."""
        piece = super().unsharded(whole)
        mesh, placements = self.tp_mesh, self.tp_own_placements
        shape, stride = self.tp_shape, self.tp_stride
        return DTensor.from_local(
            piece, mesh, placements, run_check=False, shape=shape, stride=stride
        )

    def local_grad(self, grad: DTensor, reduce_dtype: torch.dtype) -> torch.Tensor:
        return super().local_grad(grad.to_local(), reduce_dtype)  # our piece of it


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
