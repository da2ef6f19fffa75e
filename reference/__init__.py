"""twinshard.reference: FSDP (ZeRO-3) written to be read. It is the specification.

Each rank keeps 1/W of every parameter (a row-block, as a ``DTensor``). A module's forward
is bracketed by an all-gather of its parameters before and a free after; its backward by
another all-gather before and a reduce-scatter of its gradients after. Nothing overlaps:
one stream, blocking collectives, one collective per parameter, so a debugger stepping
through a training step sees exactly one thing happen at a time.

Two readings. The core, in this folder, is FSDP for a plain parameter: read it in one sitting,
in this order:

    mesh.py             which ranks hold which piece (FSDP on 1D meshes, HSDP on 2D)
    collectives.py      all-gather, reduce-scatter, all-reduce: padding rows to split evenly
    sharded_param.py    one parameter: sharded, unsharded, how memory is freed; its gradient
    layout.py           the three moments where features differ, for a plain parameter
    param_group.py      one fully_shard call's parameters through a training step
    state.py            the hooks: when forward and backward reach a module; mixed precision
    fully_shard.py      the entry point

The second reading, ``more/``, holds what FSDP2 does beyond that, each feature reached from the
core through a named seam; ``more/__init__.py`` lists its files in reading order, and the seams.
"""

from twinshard.api import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    FSDPUsageError,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
    register_fsdp_forward_method,
)

from .fully_shard import fully_shard
from .more.fsdp_module import FSDPModule, share_comm_ctx

__all__ = ["CPUOffloadPolicy", "DataParallelMeshDims", "FSDPModule", "FSDPUsageError",
           "MixedPrecisionPolicy", "OffloadPolicy", "UnshardHandle", "fully_shard",
           "register_fsdp_forward_method", "share_comm_ctx"]  # fmt: skip
