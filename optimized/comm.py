"""Where the optimized implementation's collectives run, and how they are ordered.

One ``CommContext`` per root module, shared by all its parameter groups. It owns the side
streams (on an accelerator) and the state that must outlive one group's hook: the all-gather
result still being copied out, the reduce-scatter still in flight, the forward order of the
groups (for implicit prefetch) and the post-optimizer event.

On the CPU there are no streams: collectives are issued with ``async_op=True`` and their work
handles are waited on exactly where the data is needed, which gives the same overlap
(gloo runs the collective on its own threads while the main thread computes).

[Note: memory that crosses streams]
A buffer allocated on one stream and used by another must not be freed until the using
stream is done with it, or the caching allocator may hand it out again too early. We never
call ``record_stream``; instead each buffer is kept alive in this context until the stream
that allocated it has waited on an event recorded after its last use. That makes the point
where memory is freed deterministic: at the next all-gather (or reduce-scatter) of the same
kind, not whenever the allocator notices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AllGatherResult:
    """An all-gather in flight: wait on ``work`` (CPU) or ``event`` (accelerator)."""

    work: Any  # torch.distributed.Work or None
    event: Any  # device event recorded after the all-gather, or None
    send: torch.Tensor  # (per-rank numel,) this rank's flat input
    recv: torch.Tensor  # (group size * per-rank numel,) everybody's blocks, rank-major
    group_size: int


@dataclass
class ReduceScatterResult:
    """A reduce-scatter in flight for one group, with what its copy-out needs."""

    work: Any
    event: Any
    flat: torch.Tensor  # (S * per-rank numel,) the packed gradients; kept until done
    out: torch.Tensor  # (per-rank numel,) this rank's reduced block of every gradient
    group: Any  # the FlatParamGroup whose gradients these are
    params: list  # the ShardedParams in ``out``, in order


@dataclass
class CommContext:
    device: torch.device
    forward_order: list = field(default_factory=list)  # groups, as the last forward ran them
    current_order: list = field(default_factory=list)  # being recorded by this forward
    pending_reduce: ReduceScatterResult | None = None  # released at the next reduce-scatter
    last_all_gather: tuple | None = None  # (buffers, event): freed once the streams waited
    post_optim_event: Any = None

    def __post_init__(self):
        self.streams = self.device.type not in ("cpu", "meta")
        if self.streams:
            module = torch.get_device_module(self.device.type)
            # builds the flat all-gather input while the previous group still computes
            self.copy_in_stream = module.Stream(self.device)
            # runs all-gathers beside compute
            self.all_gather_stream = module.Stream(self.device)
            # runs reduce-scatters beside the backward of earlier layers
            self.reduce_scatter_stream = module.Stream(self.device)
            # HSDP: runs the all-reduce across replicas after the reduce-scatter
            self.all_reduce_stream = module.Stream(self.device)

    def wait(self, result) -> None:
        """Make the caller (CPU) or the current stream (accelerator) wait for ``result``."""
        if result.work is not None:
            result.work.wait()
        if result.event is not None:
            self.current_stream().wait_event(result.event)

    def current_stream(self):
        return torch.get_device_module(self.device.type).current_stream(self.device)

    def stream(self, s):
        return torch.get_device_module(self.device.type).stream(s)

    def before_all_gather(self) -> None:
        """Order the side streams after the compute that produced the shards (or after the
        optimizer step's event), and release the previous all-gather's buffers."""
        if not self.streams:
            return
        wait_for = self.post_optim_event
        for s in (self.copy_in_stream, self.all_gather_stream):
            if wait_for is not None:
                s.wait_event(wait_for)
            else:
                s.wait_stream(self.current_stream())
        self.post_optim_event = None
        if self.last_all_gather is not None:  # see [Note: memory that crosses streams]
            _, event = self.last_all_gather
            self.copy_in_stream.wait_event(event)
            self.all_gather_stream.wait_event(event)
            self.last_all_gather = None
