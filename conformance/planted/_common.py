"""The interface names every planted module re-exports from the reference."""

from twinshard.reference import (  # noqa: F401
    CPUOffloadPolicy,
    FSDPModule,
    FSDPUsageError,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
    register_fsdp_forward_method,
)
