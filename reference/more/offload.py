"""Second reading. CPU offload: shards and gradients in host memory, computed on the device.

With ``offload_policy=CPUOffloadPolicy()`` the ``Offload`` layout keeps a shard in host memory
(``shard_device``); an unshard copies it to the device before the all-gather, a reduced
gradient goes back (``grad_block``), and so does a shard that ``module.to_empty`` moved
(``settle``). On an accelerator the host memory is pinned (the default), so a copy runs without
staging and the host need not wait: a new gradient is copied without waiting, and the root
waits for the device once, at the end of backward (``wait_for_grad_copies``). A gradient added
to an earlier one, or that a hook reads right away, must be in place first: that copy waits.
"""

from __future__ import annotations

import torch

from ..layout import Layout


class Offload(Layout):
    """The layout of a parameter whose shard lives in host memory."""

    plain = False

    def setup(self, *, offload, **_) -> None:
        self.shard_device = torch.device("cpu")
        # Pinned host memory lets the copy to an accelerator run without staging.
        self.pin = offload.pin_memory and self.device.type != "cpu"
        self.non_blocking = self.pin  # pinned: the host goes on
        self.grad_in_flight = False  # a copy to host memory not yet waited for
        self.plain = self.device.type == "cpu"  # there the host's memory is the device's

    def kept_shard(self, block: torch.Tensor) -> torch.Tensor:
        return block.pin_memory() if self.pin and block.device.type == "cpu" else block

    def grad_block(self, p, block: torch.Tensor) -> torch.Tensor:
        """The reduced block copied to host memory, without waiting where nothing reads it
        before the end of backward."""
        block = super().grad_block(p, block)
        hooks = p.sharded_param._post_accumulate_grad_hooks
        if not self.pin or p.sharded_param.grad is not None or hooks:
            return block.to(self.shard_device)
        self.grad_in_flight = True
        return block.to(self.shard_device, non_blocking=True)  # torch pins what it copies to

    def settle(self, p) -> None:  # a shard moved with the module (to_empty) goes back
        local = p.local_shard
        if local.device != self.shard_device:
            p.adopt_local(self.kept_shard(local.to(self.shard_device)))

    def took_copies(self) -> bool:
        """Whether a gradient was copied to host memory without waiting; forgets it."""
        found, self.grad_in_flight = self.grad_in_flight, False
        return found


def wait_for_grad_copies(groups: list) -> None:
    """End of backward (the root): wait for the device once if any of the ``ParamGroup``s
    copied gradients to pinned host memory without waiting since the last call."""
    offloaded = [g for g in groups if copies_in_flight(g)]
    if offloaded:
        torch.get_device_module(offloaded[0].device.type).synchronize()


def copies_in_flight(group) -> bool:
    """Whether ``group`` copied a gradient to host memory without waiting; forgets them."""
    layouts = [p.layout for p in group.params]  # one offload policy per group:
    return (
        bool(layouts)
        and getattr(layouts[0], "pin", False)
        and any([layout.took_copies() for layout in layouts])
    )
