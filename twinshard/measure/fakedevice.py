"""The fake accelerator: a device that torch treats as its accelerator, on a CPU-only build.

``register`` renames torch's ``PrivateUse1`` slot to ``fakecuda``, makes ``fakecuda.py`` its
device module and installs ``_Hooks`` and ``_Guard``, the two things ATen asks of the slot;
``fake_group`` registers PyTorch's fake process group for one device type and
``backend_name`` names it. Why a ``PrivateUse1`` device and not ``cuda``, and why a run needs
a process of its own (``runner`` spawns one): the page this file is shown on,
docs/fake-accelerator.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import fakecuda
from .fakecuda import DEVICE_TYPE  # the PrivateUse1 device's name: a stand-in for cuda

BACKEND = "fakeaccel"  # the process-group backend registered for it

_registered = False


def is_registered() -> bool:
    """Whether this process has the fake accelerator (``register`` ran here)."""
    return _registered


def device() -> torch.device:
    """The device a rank computes on: the fake accelerator's device 0."""
    return torch.device(DEVICE_TYPE, 0)


def register() -> torch.device:
    """Make the fake accelerator this process's accelerator; idempotent, not reversible."""
    global _registered
    if _registered:
        return device()
    current = torch.accelerator.current_accelerator()
    if current is not None:
        raise RuntimeError(
            f"twinshard.measure.fakeaccel.register: this process already has the accelerator "
            f"{current.type!r}; run the fake-accelerator run in a process of its own "
            "(twinshard.measure.fakeaccel.runner.run spawns one)"
        )
    torch.utils.rename_privateuse1_backend(DEVICE_TYPE)
    torch._register_device_module(DEVICE_TYPE, fakecuda)
    torch._C._acc.register_python_privateuseone_hook(_Hooks())
    torch._C._acc.register_python_privateuseone_device_guard(_Guard())
    _registered = True
    return device()


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    """What ATen asks of the PrivateUse1 backend: it is built, available and initialized."""

    def is_available(self) -> bool:
        return True

    def is_built(self) -> bool:
        return True

    def has_primary_context(self, device_index: int) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):
    """The device guard ATen opens around an operator on the device: it names the type."""

    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


def _make_fake_group(common, options):
    from torch._C._distributed_c10d import FakeProcessGroup

    return FakeProcessGroup._create_internal(common.group_rank, common.group_size, options)


_backends: set[str] = set()  # the device types a fake process-group backend is registered for


def fake_group(device_type: str | None = None) -> str:
    """The backend name of PyTorch's fake process group for ``device_type`` alone, registered
    on first use. ``device_type`` None is the fake accelerator
    (registered first); a real one (``cuda``) gives its real tensors a world of W ranks in one
    process, for the checks on a lent GPU. ``measure.world.join`` joins it."""
    if device_type is None:
        register()
        device_type = DEVICE_TYPE
    name = backend_name(device_type)
    if device_type not in _backends:
        dist.Backend.register_backend(
            name, _make_fake_group, extended_api=True, devices=[device_type]
        )
        _backends.add(device_type)
    return name


def backend_name(device_type: str) -> str:
    """The fake process group's backend name for ``device_type``."""
    return BACKEND if device_type == DEVICE_TYPE else f"fake_on_{device_type}"
