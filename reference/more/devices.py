"""Second reading. The device a rank computes on, for the mesh ``fully_shard`` builds itself.

Without a mesh, ``fully_shard`` builds a 1D one over every rank on the device type this rank
computes on, which, as in PyTorch's FSDP2, the accelerator API says: not the backend's name
(no backend, or ``"cpu:gloo,cuda:nccl"``, reaches the GPU as ``"nccl"`` does). An int
``reshard_after_forward`` of N needs the same ranks in rows of N (``rows_mesh``), built on the
host even under a ``FakeTensorMode``, where the mesh's rank tensor cannot be read.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh


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


def rows_mesh(mesh: DeviceMesh, n: int) -> DeviceMesh:
    """``mesh``'s ranks as rows of ``n`` consecutive ranks, (size / n, n), a new mesh."""
    with unset_fake_temporarily():  # the rank tensor's values, on the host
        return DeviceMesh(mesh.device_type, mesh.mesh.reshape(-1, n))
