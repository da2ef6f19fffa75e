"""twinshard.reference: FSDP (ZeRO-3) written to be read. It is the specification.

Each rank keeps 1/W of every parameter (a row-block, as a ``DTensor``). A module's forward
is bracketed by an all-gather of its parameters before and a free after; its backward by
another all-gather before and a reduce-scatter of its gradients after. Nothing overlaps:
one stream, blocking collectives, one collective per parameter, so a debugger stepping
through a training step sees exactly one thing happen at a time.

Read in this order:

    mesh.py           which ranks hold which piece (FSDP on 1D meshes, HSDP on 2D)
    collectives.py    all-gather, reduce-scatter, all-reduce: padding rows to split evenly
    sharded_param.py  one parameter: sharded, unsharded, and how memory is freed
    param_group.py    one fully_shard call's parameters through a training step
    mixed_precision.py  the dtype casts of MixedPrecisionPolicy
    state.py          the hooks that find out when forward and backward reach a module
    fully_shard.py    the entry point and the FSDPModule methods
"""

from twinshard.api import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    FSDPUsageError,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
)

from .fsdp_module import FSDPModule, register_fsdp_forward_method, share_comm_ctx
from .fully_shard import fully_shard

__all__ = ["CPUOffloadPolicy", "DataParallelMeshDims", "FSDPModule", "FSDPUsageError",
           "MixedPrecisionPolicy", "OffloadPolicy", "UnshardHandle", "fully_shard",
           "register_fsdp_forward_method", "share_comm_ctx"]  # fmt: skip
