"""The fake accelerator: a device that torch treats as its accelerator, on a CPU-only build.

Why not ``cuda`` itself. A CPU build of torch makes ``FakeTensor``s on device ``cuda``, but
cannot run a training step with them: the Python bindings of many operators (``copy_``,
indexing, ``uniform_``, ``split_with_sizes_copy``) open a CUDA device guard, which a CPU build
does not have, and autograd's engine, before it runs a backward over CUDA tensors, asks for
the accelerator's streams, and a CPU build has no accelerator to ask. Nothing in Python can
make a CPU build's accelerator CUDA.

What works is a device of torch's own extension slot (``PrivateUse1``) registered from
Python: renamed ``fakecuda``, with a Python device guard and Python hooks that say it is built
and available, it *is* then torch's accelerator (``torch.accelerator.current_accelerator()``
names it), so autograd, ``DeviceMesh``, DTensor, the optimizers and FSDP2 treat it as they
treat CUDA, through ``torch.get_device_module``, which answers with ``fakecuda`` (streams and
events, the current device, the RNG). The tensors on it are ``FakeTensor``s: shapes, dtypes
and devices, no values, so ``.item()`` cannot answer and a step costs no arithmetic.

The process group is PyTorch's fake one, registered for this device only (``fake_group``): a
collective of tensors on the device returns at once; one of host tensors has no backend, as
on NCCL (inside ``FakeTensorMode`` a fake host tensor still passes, so ``monitor`` checks
every collective's devices itself).

These registrations are process-wide and cannot be undone: a run lives in a process of its
own (``runner`` spawns one).
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
    """The backend name of PyTorch's fake process group for ``device_type`` alone (see the
    module docstring), registered on first use. ``device_type`` None is the fake accelerator
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
