"""The memory predictor: a job's step recorded on the fake accelerator, with the caching
allocator's model replayed over it.

Nothing here is written per implementation. ``record(job)`` trains the job's steps as rank 0 of
its world on the fake accelerator, through the measuring layer's one loop
(``observe.record``): the implementation's own code runs on ``FakeTensor``s, a
``monitor.Monitor`` keeps every allocation and free of the device (its ``alloc_log``), and a
``probe.Probe`` sorts what FSDP holds into ``probe.CATEGORIES``. ``prediction`` turns that
into the figures the commands show: the categories at the last step's peak, the device's
allocated peak, and the reserved peak of PyTorch's caching allocator replaying the same
requests (``allocator.replay``, plain segments).

The fake accelerator's run (``fakeaccel.runner.check``, many jobs in one spawned process: the
registration is for good) records through ``record`` and reports the prediction;
``twinshard bench`` takes it from there to show it beside its measurement. The plan records
through the same loop with its own observer (``plan/runner.py``). How to read it:
docs/benchmarks.md, "The memory prediction".
"""

from __future__ import annotations

from . import allocator, observe
from .fakecuda import DEVICE_TYPE
from .monitor import Monitor
from .probe import CATEGORIES, Probe, sharded_modules

STEPS = 2  # the first step initializes lazily; the second is the steady state


def record(job, steps: int = STEPS, ready=None, **where) -> tuple[Monitor, list]:
    """``job``'s steps on the fake accelerator in this process, a probe plugged in: the
    monitor and its phases, setup first. ``ready(model)``: called once the model is sharded
    (the fake accelerator's checks plant a hazard there); ``where``: ``observe.record``'s
    options for another device (the same checks on a lent GPU, whose allocations the
    monitor does not log: its own allocator has them)."""

    def logging_monitor(device) -> Monitor:  # the fake device's allocations and frees kept
        monitor = Monitor(device.type)
        monitor.alloc_log = [] if device.type == DEVICE_TYPE else None
        return monitor

    def attach(monitor, model, opt):
        if ready is not None:
            ready(model)
        monitor.probe = Probe(model, opt, sharded_modules(model))

    return observe.record(job, logging_monitor, steps, ready=attach, **where)


def prediction(monitor: Monitor, phases: list) -> dict:
    """What FSDP holds at the last step's peak by category, and the device's peaks over every
    step: allocated (the blocks the allocator hands out, rounded to 512 bytes) and reserved
    (the segments it keeps); without an allocation log (a real device), the latter two are
    None."""
    categories = {c: phases[-1].categories.get(c, 0) for c in CATEGORIES}
    out = {"categories": categories, "fsdp_total": sum(categories.values())}
    stats = allocator.replay(monitor.alloc_log).stats if monitor.alloc_log is not None else None
    out["allocated_peak"] = stats.peak_allocated if stats else None
    out["reserved_peak"] = stats.peak_reserved if stats else None
    return out
