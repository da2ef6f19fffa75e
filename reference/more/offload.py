"""Second reading. CPU offload: shards and gradients in host memory, computed on the device.

With ``offload_policy=CPUOffloadPolicy()`` a parameter's shard lives in host memory
(``ShardedParam.shard_device`` is the CPU) while forward and backward run on the compute
device. The core does the two moves itself: an unshard copies the shard to the device before
the all-gather (``all_gather_input``), and ``refresh`` brings a shard that ``module.to_empty``
put on the device back to the host. What is left is the gradient's way back, here.

On an accelerator the host memory is pinned (``pin_memory=True``, the default), so a copy
between host and device runs without staging, and the host need not wait for it. A new
gradient is copied to the host without waiting; the root waits for the device once, at the
end of backward, for all of them (``wait_for_grad_copies``). A gradient that is added to an
earlier one, or that a hook reads right away, must be in place first, so that copy waits.
"""

from __future__ import annotations

import torch


def grad_to_host(p, block: torch.Tensor) -> torch.Tensor:
    """Copy a reduced block (local_rows, *rest) of the offloaded ``ShardedParam`` ``p`` to host
    memory, without waiting where nothing reads it before the end of backward."""
    hooks = p.sharded_param._post_accumulate_grad_hooks
    if not p.pin or p.sharded_param.grad is not None or hooks:
        return block.to(p.shard_device)
    p.grad_in_flight = True
    return block.to(p.shard_device, non_blocking=True)  # torch pins what it copies to


def wait_for_grad_copies(groups: list) -> None:
    """End of backward (the root): wait for the device once if any of the ``ParamGroup``s
    copied gradients to pinned host memory without waiting since the last call."""
    offloaded = [g for g in groups if copies_in_flight(g)]
    if offloaded:
        torch.get_device_module(offloaded[0].device.type).synchronize()


def copies_in_flight(group) -> bool:
    """Whether ``group`` copied a gradient to host memory without waiting; forgets them."""
    if not group.params or not group.params[0].pin:  # one offload policy per group
        return False
    found = any([p.grad_in_flight for p in group.params])
    for p in group.params:
        p.grad_in_flight = False
    return found
