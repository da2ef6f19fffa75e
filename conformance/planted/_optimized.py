"""The interface names every module planted in the optimized path re-exports from it."""

from twinshard.optimized import (  # noqa: F401
    CPUOffloadPolicy,
    FSDPModule,
    FSDPUsageError,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
    register_fsdp_forward_method,
)
from twinshard.optimized import fully_shard as optimized_fully_shard  # noqa: F401
