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
computes on. As in PyTorch's FSDP2, the accelerator API says which (``default_device_type``):
the backend's name does not, since a group made with no backend, or with
``"cpu:gloo,cuda:nccl"``, reaches the GPU as well as one made with ``"nccl"``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from twinshard.api import FSDPUsageError


@dataclass
class MeshInfo:
    """The groups a parameter group communicates over."""

    mesh: DeviceMesh
    shard_group: dist.ProcessGroup  # all-gather and reduce-scatter run here
    shard_size: int  # S: how many pieces a parameter is cut into
    shard_rank: int  # which piece this rank keeps
    replicate_group: dist.ProcessGroup | None  # HSDP: gradients are all-reduced here
    replicate_size: int  # R: 1 for FSDP

    @property
    def placements(self) -> tuple:
        """DTensor placements of a sharded parameter on ``mesh``."""
        return (Shard(0),) if self.replicate_group is None else (Replicate(), Shard(0))

    @property
    def shard_mesh(self) -> DeviceMesh:
        """The 1D mesh of the shard group (what an all-gather extension is handed, HSDP too)."""
        return self.mesh if self.replicate_group is None else self.mesh[self.mesh.mesh_dim_names[1]]

    @property
    def device(self) -> torch.device:
        """The compute device of this rank: the mesh's device type, current index."""
        kind = self.mesh.device_type
        if kind == "cpu":
            return torch.device("cpu")
        return torch.device(kind, torch.get_device_module(kind).current_device())


def backends_by_device(group=None) -> dict[str, str]:
    """Which backend runs a collective of each device type in ``group`` (default: the default
    group): ``{"cpu": "gloo", "cuda": "nccl"}`` for ``"cpu:gloo,cuda:nccl"``; plain ``"gloo"``
    serves both the CPU and cuda, plain ``"nccl"`` cuda only."""
    config = dist.get_backend_config(group)  # "cpu:gloo,cuda:nccl"
    pairs = (item.split(":", 1) for item in config.split(",") if ":" in item)
    return {device.strip(): name.strip() for device, name in pairs}


def default_device_type() -> str:
    """The device type this rank computes on, asked as PyTorch's FSDP2 asks it.

    The device the default group is bound to (``init_process_group(device_id=...)``); else the
    accelerator that ``torch.accelerator`` names, if one is available and the default group
    has a backend for its device type; else the CPU. Never the backend's name: ``"nccl"``, no
    backend at all and ``"cpu:gloo,cuda:nccl"`` all mean cuda on a GPU machine, and an XPU or
    an out-of-tree device answers the same way.
    """
    bound = dist.group.WORLD.bound_device_id
    if bound is not None:
        return bound.type
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is not None and accelerator.type in backends_by_device():
        return accelerator.type
    return "cpu"


def default_mesh() -> DeviceMesh:
    """A 1D mesh over every rank of the default process group (plain FSDP), on the device
    type this rank computes on (``default_device_type``)."""
    if not dist.is_initialized():
        raise FSDPUsageError(
            "fully_shard needs torch.distributed: call init_process_group first "
            "(twinshard.launch does it for you) or pass mesh=..."
        )
    return init_device_mesh(default_device_type(), (dist.get_world_size(),))


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
    """The group to keep parameters sharded over between forward and backward.

    ``None`` means: keep them unsharded. ``info`` itself means: reshard fully (True).
    """
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
    small = DeviceMesh(info.mesh.device_type, info.mesh.mesh.reshape(-1, n))
    return MeshInfo(small, small.get_group(1), n, small.get_local_rank(1), None, 1)


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
