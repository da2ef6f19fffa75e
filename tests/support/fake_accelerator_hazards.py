"""Hazards planted into a model, so that the tests of the fake-accelerator run can fail.

Each is a forward hook on the first block that does what a hook must not do on an
accelerator; ``planter(name)`` is what attaches one, for ``fakeaccel.runner.check``'s
``plant``. The run must report it, and where (``tests/measuring/test_fake_accelerator.py``):

    item                    reads a device value on the host (``.item()``): a host sync
    blocking_copy           copies the block's output to the host, blocking: a host sync
    host_collective         all-reduces a tensor made on the host: NCCL has no host backend
    device_only_collective  all-reduces the output only where it is not on the CPU: the
                            fake-accelerator run issues a collective the CPU run does not
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _item(module, args, output):
    output.float().mean().item()


def _blocking_copy(module, args, output):
    output.to("cpu")


def _host_collective(module, args, output):
    dist.all_reduce(torch.ones(1))


def _device_only_collective(module, args, output):
    if output.device.type != "cpu":
        dist.all_reduce(output.detach().clone())


HAZARDS = {
    "item": _item,
    "blocking_copy": _blocking_copy,
    "host_collective": _host_collective,
    "device_only_collective": _device_only_collective,
}


def planter(name: str):
    """What attaches hazard ``name`` (a key of ``HAZARDS``) to a model's first block."""
    hook = HAZARDS[name]
    return lambda model: model.blocks[0].register_forward_hook(hook)
