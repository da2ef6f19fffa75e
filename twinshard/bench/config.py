"""What one benchmark run is, and which implementations the bench compares.

``RunConfig`` is the measuring layer's one job (``twinshard.measure.job.Job``), everything a
process needs to build the model and train it (``twinshard.measure.step.build`` builds it).
Five implementations are compared by default:

    plain      the model without any wrapper: each rank trains a full replica on its own slice
               and nothing is communicated (the compute floor)
    ddp        torch's DistributedDataParallel (the data-parallel baseline)
    reference  twinshard.reference.fully_shard (the readable spec)
    optimized  twinshard.optimized.fully_shard (the fast path)
    torch      torch.distributed.fsdp.fully_shard (FSDP2)

and any importable module with the ``fully_shard`` interface runs as the last three do
(``twinshard.impls`` resolves the name, as for every command).
"""

from __future__ import annotations

from twinshard.measure.job import BACKENDS, BASELINES, SHARDED, Job

RunConfig = Job  # the name the runners know the job by
IMPLS = BASELINES + SHARDED  # the five compared by default
FAKEACCEL_RUNS = "--backend fakeaccel runs FSDP implementations only (not plain or ddp)"
__all__ = ["BACKENDS", "BASELINES", "FAKEACCEL_RUNS", "IMPLS", "SHARDED", "RunConfig"]
