"""twinshard.optimized: the same FSDP, built for speed.

Same interface and same results as ``twinshard.reference`` (the specification); what
changes is how the work is scheduled:

- one all-gather and one reduce-scatter per parameter group, through flat buffers, with a
  fused split-copy out and foreach gradient accumulation (``flat_group.py``);
- collectives run asynchronously (work handles on the CPU, side streams and events on an
  accelerator), overlapping with compute (``comm.py``);
- the next group's all-gather is issued before the current group computes, in forward and
  backward, one group ahead (``state.py``).

``twinshard.optimized.in_pieces`` is the same implementation with a parent of sharded modules
sharded in pieces, each gathered and reduced where it is used (``pieces.py``).
"""

from twinshard.api import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    FSDPUsageError,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
)

from .fully_shard import FSDPModule, fully_shard, register_fsdp_forward_method, share_comm_ctx

__all__ = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "FSDPUsageError",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
