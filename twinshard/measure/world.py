"""Joining a world of W ranks: one function decides how, joins, and names the device to use.

    join(kind, world, device="cpu", link="ib", latency_us=None) -> torch.device

``kind`` is the job's backend, or ``lent``:

    gloo, nccl  launched ranks: ``twinshard.ranks.launch`` (or torchrun) made the group already, one
                process per rank (``devices.join_group``); nothing to join here
    fake        one process as rank 0 of ``world``: PyTorch's fake process group (collectives
                return at once and move nothing)
    simnet      one process as rank 0 on the simulated network (``twinshard/measure/simnet.py``):
                collectives take the time of ``link``
    fakeaccel   one process as rank 0 on the fake accelerator (``twinshard/measure/fakedevice.py``):
                ``fakecuda``, with the fake process group registered for it alone
    lent        one process as rank 0 on a real accelerator (``device``, such as ``cuda``),
                with the fake process group registered for that device alone, as for the
                fake accelerator: a lent GPU plays rank 0 of W

A one-process world leaves any group this process had before (the fake-accelerator run
joins twice: on its device, then on the CPU). The backends stay registered where they are
written (``simnet``, ``measure.fakedevice``); only this module chooses between them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from twinshard.ranks import devices

LAUNCHED = ("gloo", "nccl")
ONE_PROCESS = ("fake", "simnet", "fakeaccel", "lent")
KINDS = LAUNCHED + ONE_PROCESS


def join(
    kind: str,
    world: int,
    device: str = "cpu",
    link: str = "ib",
    latency_us: float | None = None,
) -> torch.device:
    """Be a rank of a world of ``world`` ranks (see the module docstring); the device this
    rank computes on."""
    if kind not in KINDS:
        raise ValueError(f"no way to join a world of kind {kind!r}; use {', '.join(KINDS)}")
    if kind in LAUNCHED:
        if dist.get_world_size() != world:
            raise RuntimeError(f"this rank's group has {dist.get_world_size()} ranks, not {world}")
        return _on(device)
    if dist.is_initialized():
        dist.destroy_process_group()
    if kind == "simnet":
        from twinshard.measure.simnet import init, parse_link

        init(world, parse_link(link, latency_us))
        return _on(device)
    if kind == "fake":
        import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers "fake"

        backend, on = "fake", _on(device)
    else:  # the fake group for this device type alone, registered by the fake accelerator
        from twinshard.measure.fakedevice import device as fake_device
        from twinshard.measure.fakedevice import fake_group

        backend = fake_group(None if kind == "fakeaccel" else device)
        on = fake_device() if kind == "fakeaccel" else _on(device)
    # an in-process store: one process plays every rank and needs no peers
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=world)
    return on


def _on(device: str) -> torch.device:
    """The device of type ``device`` this process uses: an accelerator's current one."""
    if device != "cpu" and not torch.get_device_module(device).is_available():
        raise RuntimeError(f"no {device!r} device here to join a world on")
    return devices.current_device(device)
