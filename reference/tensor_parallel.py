"""FSDP over tensor parallelism (2-D): parameters that are already ``DTensor``s.

With tensor parallelism, ``parallelize_module(model, mesh["tp"], plan)`` turns a layer's weight
into a ``DTensor`` on the ``tp`` mesh: each rank holds a TP piece (say, every other output
row). ``fully_shard(block, mesh=mesh["dp"])`` then shards that *piece* across the ``dp`` mesh,
exactly as it shards a whole parameter in 1-D: the TP piece plays the part of the parameter.

Two things change around it:

- the sharded parameter is a ``DTensor`` on the whole 2-D mesh (``dp``, ``tp``), whose
  placements say both cuts: ``Shard(0)`` on ``dp`` (or ``_StridedShard(0)``, when TP also cut
  dim 0: FSDP's rows are then rows of each TP piece, not of the whole tensor) and TP's own;
- the unsharded parameter, which the TP layers compute with, is again a ``DTensor`` on the
  ``tp`` mesh, wrapping the all-gathered piece; its gradient is one too, and FSDP reduces the
  gradient's TP piece.

``TPLayout`` holds what a parameter needs for this; ``tp_layout`` finds it (or None: 1-D).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from twinshard.api import FSDPUsageError

from .mesh import MeshInfo


@dataclass
class TPLayout:
    tp_mesh: DeviceMesh  # the mesh the TP layers compute on
    tp_placements: tuple  # the parameter's placements on it
    spmd_mesh: DeviceMesh  # (dp, tp): where the sharded parameter lives
    shape: torch.Size  # the whole (global) parameter
    stride: tuple

    def sharded_placements(self, info: MeshInfo) -> tuple:
        """Placements of the sharded parameter on (dp, tp)."""
        cut_by_tp = sum(isinstance(p, Shard) and p.dim == 0 for p in self.tp_placements)
        tp_size = self.tp_mesh.size()
        dp = _StridedShard(0, split_factor=tp_size) if cut_by_tp else Shard(0)
        return (dp, *self.tp_placements)

    def unsharded(self, piece: torch.Tensor) -> DTensor:
        """The gathered TP piece as the DTensor the TP layers expect."""
        return DTensor.from_local(
            piece,
            self.tp_mesh,
            self.tp_placements,
            run_check=False,
            shape=self.shape,
            stride=self.stride,
        )


def tp_layout(param: torch.nn.Parameter, info: MeshInfo, where: str) -> TPLayout | None:
    """The TP layout of ``param`` when tensor parallelism made it a DTensor, else None."""
    if not isinstance(param, DTensor):
        return None
    mesh, placements = param.device_mesh, tuple(param.placements)
    dp_name = (info.mesh.mesh_dim_names or [None])[0]
    if mesh.ndim == 2 and dp_name in (mesh.mesh_dim_names or ()):  # on the whole (dp, tp) mesh
        dp_dim = mesh.mesh_dim_names.index(dp_name)
        if not placements[dp_dim].is_replicate():
            raise FSDPUsageError(f"parameter '{where}' must be replicated on the dp mesh dim")
        placements = placements[1 - dp_dim : 2 - dp_dim]
        mesh = mesh[mesh.mesh_dim_names[1 - dp_dim]]
    if info.replicate_group is not None or mesh.ndim != 1:
        raise FSDPUsageError(
            f"parameter '{where}' is a DTensor on a {mesh.ndim}-D mesh; twinshard shards "
            "tensor-parallel parameters of a 1-D tp mesh over a 1-D dp mesh (FSDP + TP); "
            "HSDP with TP and more dims are not supported"
        )
    if any(not isinstance(p, (Shard, Replicate)) for p in placements):
        raise FSDPUsageError(f"parameter '{where}': TP placements {placements} unsupported")
    root = mesh._get_root_mesh()  # the 2-D mesh that mesh["tp"] and mesh["dp"] were cut from
    dp_first = root.ndim == 2 and root.mesh_dim_names[0] == (info.mesh.mesh_dim_names or [""])[0]
    if not dp_first or root is not info.mesh._get_root_mesh():
        raise FSDPUsageError(
            f"parameter '{where}' is a DTensor on a mesh that is not the second dim of the dp "
            "mesh's 2-D mesh; build one named mesh (dp, tp), dp first, and pass mesh['tp'] to "
            "parallelize_module and mesh['dp'] to fully_shard"
        )
    return TPLayout(mesh, placements, root, param.shape, param.stride())
