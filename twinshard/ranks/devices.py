"""The device each rank computes on, decided in one place, from the accelerator API.

Deciding it from the backend's name ("cuda" when the default group is "nccl") gives a CPU mesh
on a GPU machine whenever the group was made another way: ``init_process_group()`` with no
backend, ``"cpu:gloo,cuda:nccl"``, ``xccl``, a third-party backend. PyTorch's FSDP2 asks the
accelerator API (``torch.accelerator``) instead, and so does twinshard, everywhere it needs the
answer (the reference's default mesh, ``twinshard train``, the conformance cases). A rank
computes on

1. the device twinshard gave it when it made the default group (``join_group``, called by
   ``twinshard.ranks.launch`` and by ``twinshard train`` under torchrun), while that group is the
   default one: accelerator ``local_rank`` for a backend that runs on an accelerator only
   (nccl, xccl, a third-party device backend), the CPU for a host backend (gloo, mpi), even
   on a GPU machine;
2. else what ``default_device_type`` says, which is FSDP2's rule: the device
   the default group is bound to (``init_process_group(device_id=...)``); else the
   accelerator ``torch.accelerator`` names, if one is available at run time and the default
   group has a backend for its device type (``"gloo"`` has one for cuda, ``"cpu:gloo"`` has
   not); else the CPU.

The reference's default mesh follows rule 2 only (the spec knows no launcher), as torch's
``fully_shard`` does. Nothing here is CUDA-specific: an XPU, an out-of-tree device or a Python
PrivateUse1 device answers through the same API. The launcher and ``twinshard train`` also ask
this module which backend suits the machine (``accelerator_backend``), how a rank joins its
group (``join_group``, with ``init_args``: ``device_id`` for an accelerator rank, as torch
recommends for NCCL, so that the communicator is made at once and the rank bound to its
device), whether forking is still safe (``initialized_accelerator``); the watchdog asks
whether a rank's collectives return once they are queued on a device stream
(``collectives_return_when_queued``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "HOST_WAITING_BACKENDS",
    "accelerator_backend",
    "accelerator_count",
    "accelerator_type",
    "backend_device",
    "backends_by_device",
    "bind",
    "collectives_return_when_queued",
    "current_device",
    "default_device_type",
    "device_count",
    "init_args",
    "initialized_accelerator",
    "join_group",
    "rank_device",
    "rank_device_type",
    "use_device",
]

# Backends whose blocking collectives return when the collective is done, on every device.
# The others (nccl, xccl, hccl, ...) return once the collective is queued on a device stream.
HOST_WAITING_BACKENDS = ("gloo", "mpi")

# (a default group that twinshard made, the device of its ranks), set by ``bind``
_group_device: tuple[object, torch.device] | None = None


def accelerator_type() -> str | None:
    """The device type of the accelerator this process can use ("cuda", "xpu", a PrivateUse1
    name), or None. Checks availability at run time, which on CUDA may initialize the driver:
    a launcher that has yet to fork uses ``accelerator_backend`` instead."""
    found = torch.accelerator.current_accelerator(check_available=True)
    return None if found is None else found.type


def bind(device: torch.device) -> None:
    """Record that the default group, just made by twinshard, serves ranks on ``device``
    (rule 1 of the module docstring)."""
    global _group_device
    _group_device = (dist.group.WORLD, torch.device(device))


def rank_device_type() -> str:
    """The device type this rank computes on, by the rules of the module docstring."""
    if not dist.is_initialized():
        return accelerator_type() or "cpu"
    if _group_device is not None and _group_device[0] is dist.group.WORLD:
        return _group_device[1].type
    return default_device_type()


def current_device(kind: str) -> torch.device:
    """The current device of type ``kind``, with its index ("cpu" has none)."""
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.get_device_module(kind).current_device())


def rank_device() -> torch.device:
    """The device this rank computes on, with the index the rank has set as current."""
    return current_device(rank_device_type())


def _backend_devices(backend: str) -> dict[str, str]:
    """Device type -> backend name for a backend string: "nccl" or "cpu:gloo,cuda:nccl"."""
    backend = backend.lower()
    if ":" in backend:
        pairs = (item.split(":", 1) for item in backend.split(","))
        return {device.strip(): name.strip() for device, name in pairs}
    return dict.fromkeys(dist.Backend.backend_capability.get(backend, ()), backend)


def backends_by_device(group=None) -> dict[str, str]:
    """Which backend runs a collective of each device type in ``group`` (default: the default
    group): ``{"cpu": "gloo", "cuda": "nccl"}`` for ``"cpu:gloo,cuda:nccl"``; plain ``"gloo"``
    serves both the CPU and cuda, plain ``"nccl"`` cuda only."""
    config = dist.get_backend_config(group)  # "cpu:gloo,cuda:nccl"
    pairs = (item.split(":", 1) for item in config.split(",") if ":" in item)
    return {device.strip(): name.strip() for device, name in pairs}


def default_device_type() -> str:
    """The device type a rank computes on by FSDP2's rule (rule 2 of the module docstring),
    which the reference's default mesh follows: the device the default group is bound to, else
    the available accelerator the default group has a backend for, else the CPU. Never the
    backend's name: ``"nccl"``, no backend and ``"cpu:gloo,cuda:nccl"`` all mean cuda."""
    bound = dist.group.WORLD.bound_device_id
    if bound is not None:
        return bound.type
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is not None and accelerator.type in backends_by_device():
        return accelerator.type
    return "cpu"


def backend_device(backend: str, local_rank: int) -> torch.device:
    """The device a rank of ``backend`` computes on: accelerator ``local_rank`` where the
    backend (or, in ``"cpu:gloo,cuda:nccl"``, one of its parts) runs on an accelerator only,
    else the CPU (gloo, mpi: host backends)."""
    capability = dist.Backend.backend_capability
    for kind, name in _backend_devices(backend).items():
        if kind != "cpu" and "cpu" not in capability.get(name, ()):
            return torch.device(kind, local_rank)
    return torch.device("cpu")


def init_args(backend: str, local_rank: int) -> dict:
    """``init_process_group`` arguments that depend on the device: the backend, and for an
    accelerator rank ``device_id`` (the rank's device: eager initialization, device bound)."""
    device = backend_device(backend, local_rank)
    if device.type == "cpu":
        return {"backend": backend}
    return {"backend": backend, "device_id": device}


def use_device(device: torch.device) -> None:
    """Make ``device`` this process's current device (nothing to do for the CPU)."""
    if device.type != "cpu":
        torch.get_device_module(device.type).set_device(device.index)


def join_group(backend: str, local_rank: int, **kwargs) -> torch.device:
    """Join the default process group as rank ``local_rank`` of this machine on ``backend``
    (``kwargs``: the rest of ``init_process_group``'s arguments) and return the rank's device:
    made current, passed as ``device_id`` for an accelerator rank, and remembered (rule 1)."""
    device = backend_device(backend, local_rank)
    use_device(device)
    dist.init_process_group(**init_args(backend, local_rank), **kwargs)
    bind(device)
    return device


def device_count(kind: str) -> int:
    """How many devices of type ``kind`` this process sees (0 for an unknown type). On CUDA,
    asked through NVML where it can be, so that a launcher can still fork afterwards."""
    try:
        return int(torch.get_device_module(kind).device_count())
    except (AttributeError, RuntimeError):
        return 0


def accelerator_backend(nprocs: int = 1) -> str | None:
    """The backend for ``nprocs`` ranks, one per accelerator of this machine (nccl for cuda,
    xccl for xpu, what a third-party device registered), or None where there is no such
    accelerator, too few devices, or torch lacks the backend. Safe to call before forking."""
    found = torch.accelerator.current_accelerator()  # what torch was built for: no device init
    if found is None:
        return None
    name = dist.Backend.default_device_backend_map.get(found.type)
    if name is None or backend_device(name, 0).type == "cpu":
        return None  # e.g. mps, whose default backend is gloo
    if not dist.is_backend_available(name) or device_count(found.type) < max(1, nprocs):
        return None
    return name


def accelerator_count() -> int:
    """How many ranks of this machine can have an accelerator each, with its own backend: 0
    without an accelerator, or where it has no such backend (mps) or torch lacks it. Safe to
    call before forking."""
    if accelerator_backend(1) is None:
        return 0
    return device_count(torch.accelerator.current_accelerator().type)


def collectives_return_when_queued() -> bool:
    """Whether a blocking collective of this rank returns once it is queued on a device stream
    (nccl, xccl, hccl, ...: a hang then shows at the next host sync) rather than once it is
    done (gloo and mpi, and any backend on the CPU)."""
    if not dist.is_initialized():
        return False
    kind = rank_device_type()
    if kind == "cpu":
        return False
    name = backends_by_device().get(kind)
    return name is not None and name not in HOST_WAITING_BACKENDS


def initialized_accelerator() -> str | None:
    """The accelerator runtime this process has initialized ("cuda"), or None. A child forked
    after that cannot use the device, so the launcher must spawn."""
    if torch.cuda.is_initialized():
        return "cuda"
    found = torch.accelerator.current_accelerator()
    if found is None or found.type == "cuda":
        return None
    try:
        is_initialized = torch.get_device_module(found.type).is_initialized
    except (AttributeError, RuntimeError):
        return None  # a device module without the query: nothing known to protect
    return found.type if is_initialized() else None
