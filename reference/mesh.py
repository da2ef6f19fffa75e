"""Which ranks hold which piece of a parameter: the device mesh of ``fully_shard``.

A 1D mesh of W ranks is plain FSDP: every parameter is cut into W row-blocks along dim 0 and
rank r keeps block r. A 2D mesh of R x S ranks is HSDP (hybrid sharding): the S ranks of one
mesh row share the parameter between them as in FSDP, and the R rows are replicas of each other.
Gradients are reduce-scattered inside a row and then all-reduced down each column.

``reshard_after_forward`` as an int N (a divisor of S) asks for a middle ground between
keeping the whole parameter after forward and keeping 1/S of it: after forward each rank keeps
1/N, gathered again in backward among N neighbouring ranks. That needs one more process group,
built here as a second mesh that views the ranks as rows of N.

Without a mesh, ``fully_shard`` builds a 1D one over every rank, on the device this rank
computes on, asked as PyTorch's FSDP2 asks it (second reading: ``more/devices.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from twinshard.api import FSDPUsageError

from . import more


@dataclass
class MeshInfo:
    """The groups a parameter group communicates over."""

    mesh: DeviceMesh
    shard_group: dist.ProcessGroup  # all-gather and reduce-scatter run here
    shard_size: int  # S: how many pieces a parameter is cut into
    shard_rank: int  # which piece this rank keeps
    replicate_group: dist.ProcessGroup | None  # HSDP: gradients are all-reduced here
    replicate_size: int  # R: 1 for FSDP

    def placements(self, dim: int) -> tuple:
        """DTensor placements on ``mesh`` of a parameter cut along ``dim``."""
        return (Shard(dim),) if self.replicate_group is None else (Replicate(), Shard(dim))

    @property
    def device(self) -> torch.device:
        """The compute device of this rank: the mesh's device type, current index."""
        kind = self.mesh.device_type
        if kind == "cpu":
            return torch.device("cpu")
        return torch.device(kind, torch.get_device_module(kind).current_device())


def as_dtensor(block: torch.Tensor, mesh: DeviceMesh, placements, shape, stride) -> DTensor:
    """``block``, this rank's piece, as a ``DTensor`` on ``mesh`` of global ``shape`` and
    ``stride``. The spec comes from a meta stand-in: ``from_local`` would move a host block
    (offload) onto the mesh's device; as torch's, a sharded parameter stays where it lies."""
    meta = block.to("meta")
    spec = DTensor.from_local(meta, mesh, placements, run_check=False, shape=shape, stride=stride)
    return DTensor.__new__(DTensor, block, spec._spec, requires_grad=False)


def default_mesh() -> DeviceMesh:
    """A 1D mesh over every rank of the default process group (plain FSDP), on the device
    type this rank computes on (``more/devices.py``)."""
    if not dist.is_initialized():
        raise FSDPUsageError(
            "fully_shard needs torch.distributed: call init_process_group first "
            "(twinshard.ranks.launch does it for you) or pass mesh=..."
        )
    return init_device_mesh(more.default_device_type(), (dist.get_world_size(),))


def mesh_info(mesh: DeviceMesh) -> MeshInfo:
    """Read the shard and replicate groups off a 1D (FSDP) or 2D (HSDP) mesh."""
    if not isinstance(mesh, DeviceMesh):
        raise FSDPUsageError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim == 1:
        return MeshInfo(mesh, mesh.get_group(0), mesh.size(0), mesh.get_local_rank(0), None, 1)
    if mesh.ndim == 2 and not mesh.mesh_dim_names:  # as torch: which dim replicates is named
        raise FSDPUsageError(
            f"Please init the 2D mesh for HSDP with mesh_dim_names specified (fully_shard got "
            f"shape {tuple(mesh.shape)}), e.g. mesh_dim_names=('replicate', 'shard')"
        )
    if mesh.ndim == 2:
        shard = (mesh.get_group(1), mesh.size(1), mesh.get_local_rank(1))
        return MeshInfo(mesh, *shard, mesh.get_group(0), mesh.size(0))
    raise FSDPUsageError(
        f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh!r} ({mesh.ndim}D); pass its "
        "data-parallel part (1D: FSDP, 2D: HSDP), e.g. mesh['dp'], or name it with dp_mesh_dims"
    )


def post_forward_mesh_info(reshard_after_forward, info: MeshInfo) -> MeshInfo | None:
    """The group to keep parameters sharded over between forward and backward: ``None``, keep
    them unsharded; ``info`` itself, reshard fully (True)."""
    if not isinstance(reshard_after_forward, (bool, int)):
        raise FSDPUsageError(
            f"reshard_after_forward must be a bool or an int (a group size), "
            f"got {reshard_after_forward!r}"
        )
    if reshard_after_forward is True:
        return info
    if reshard_after_forward is False:
        return None
    n = reshard_after_forward
    if n < 1 or info.shard_size % n != 0:
        raise FSDPUsageError(
            f"reshard_after_forward={n} must divide the shard group size {info.shard_size} "
            f"(a group size to reshard to); use True, False or a divisor"
        )
    if n == 1:
        return None  # keeping a 1/1 piece is keeping the whole parameter
    if n == info.shard_size:
        return info
    # Rows of n consecutive ranks: rank r all-gathers with the others in its row in backward.
    small = more.rows_mesh(info.mesh, n)  # (S / n, n) ranks, built on the host
    return MeshInfo(small, small.get_group(1), n, small.get_local_rank(1), None, 1)
