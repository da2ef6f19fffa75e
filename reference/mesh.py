"""Which ranks hold which piece of a parameter: the device mesh of ``fully_shard``.

A 1D mesh of W ranks is plain FSDP: every parameter is cut into W row-blocks along dim 0 and
rank r keeps block r. A 2D mesh of R x S ranks is HSDP (hybrid sharding): the S ranks of one
mesh row share the parameter between them as in FSDP, and the R rows are replicas of each other.
Gradients are reduce-scattered inside a row and then all-reduced down each column.

Without a mesh, ``fully_shard`` builds a 1D one over every rank, on the device this rank
computes on, asked as PyTorch's FSDP2 asks it (``twinshard/ranks/devices.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from twinshard.api.arguments import check_distributed, check_mesh
from twinshard.ranks.devices import current_device, default_device_type


@dataclass
class MeshInfo:
    """The groups a parameter group communicates over."""

    mesh: DeviceMesh
    shard_group: dist.ProcessGroup  # all-gather and reduce-scatter run here
    shard_size: int  # S: how many pieces a parameter is cut into
    shard_rank: int  # which piece this rank keeps
    replicate_group: dist.ProcessGroup | None = None  # HSDP: gradients are all-reduced here
    replicate_size: int = 1  # R: 1 for FSDP

    def placements(self, dim: int) -> tuple:
        """DTensor placements on ``mesh`` of a parameter cut along ``dim``."""
        return (Shard(dim),) if self.replicate_group is None else (Replicate(), Shard(dim))

    @property
    def device(self) -> torch.device:
        """The compute device of this rank: the mesh's device type, current index."""
        return current_device(self.mesh.device_type)


def as_dtensor(block: torch.Tensor, mesh: DeviceMesh, placements, shape, stride) -> DTensor:
    """``block``, this rank's piece, as a ``DTensor`` on ``mesh`` of global ``shape`` and
    ``stride``. The spec comes from a meta stand-in: ``from_local`` would move a host block
    (offload) onto the mesh's device; as torch's, a sharded parameter stays where it lies."""
    meta = block.to("meta")
    spec = DTensor.from_local(meta, mesh, placements, run_check=False, shape=shape, stride=stride)
    return DTensor.__new__(DTensor, block, spec._spec, requires_grad=False)


def default_mesh() -> DeviceMesh:
    """A 1D mesh over every rank of the default process group (plain FSDP), on the device
    type this rank computes on."""
    check_distributed()  # a default process group to build it over
    return init_device_mesh(default_device_type(), (dist.get_world_size(),))


def mesh_info(mesh: DeviceMesh) -> MeshInfo:
    """Read the shard and replicate groups off a 1D (FSDP) or 2D (HSDP) mesh."""
    check_mesh(mesh)  # a DeviceMesh of 1 dim, or of 2 named ones (which one replicates)
    if mesh.ndim == 1:
        return MeshInfo(mesh, mesh.get_group(0), mesh.size(0), mesh.get_local_rank(0))
    shard = (mesh.get_group(1), mesh.size(1), mesh.get_local_rank(1))
    return MeshInfo(mesh, *shard, replicate_group=mesh.get_group(0), replicate_size=mesh.size(0))
