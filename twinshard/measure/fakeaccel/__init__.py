"""twinshard.measure.fakeaccel: a W-rank accelerator job played by one CPU process, and checked.

The optimized path exists for GPUs with NCCL, and CI has neither. Here one process plays one
rank of an accelerator job: a device that torch takes for its accelerator (a ``PrivateUse1``
device named ``fakecuda``, registered from Python), ``FakeTensor``s on it (shapes, dtypes,
devices; no values, no arithmetic), PyTorch's fake process group registered for that device
only, and the project's stand-in streams behind ``torch.cuda``'s API. A training step of the
reference, the optimized path or torch's ``fully_shard`` then runs the code it would run on a
GPU, at any world size, and a dispatch mode watches it for what a GPU pays for: host syncs,
host tensors in collectives, the collectives issued (compared with the CPU run of the same
configuration) and the bytes on the device (beside the memory model).

One concept per file:

    ../fakedevice.py  the fake accelerator and its fake process group (why not ``cuda``: there)
    ../fakecuda.py    its device module: streams, events, the current device, the RNG, syncs counted
    ../monitor.py     the dispatch mode: host syncs, host collectives, collectives, memory
    runner.py     one configuration on the fake accelerator and on the CPU, or on a lent GPU
                  (``benchmarks/gpu.sh``); a spawned process
    stream_order.py  the order of waits and events, compared across stand-ins and devices
    planted.py    hazards planted into a model, so that the checks can be seen to fail
    report.py     the table and the findings
    cli.py        ``python -m twinshard.measure.fakeaccel`` and ``twinshard bench --backend fakeaccel``

See ``docs/fake-accelerator.md``.
"""

from twinshard.measure.fakedevice import BACKEND, DEVICE_TYPE, is_registered, register
from twinshard.measure.monitor import Monitor

from .runner import check, run

__all__ = ["BACKEND", "DEVICE_TYPE", "Monitor", "check", "is_registered", "register", "run"]
