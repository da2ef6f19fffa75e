"""twinshard.measure.fakeaccel: a W-rank accelerator job played by one CPU process, and checked.

One process plays rank 0 of an accelerator job on a fake ``PrivateUse1`` device, and a
dispatch mode watches its training steps for what a GPU pays for. What it runs, what it checks
and what it does not see: docs/fake-accelerator.md.

One concept per file:

    ../fakedevice.py  the fake accelerator and its fake process group
    ../fakecuda.py    its device module: streams, events, the current device, the RNG, syncs counted
    ../monitor.py     the dispatch mode: host syncs, host collectives, collectives, memory
    runner.py     one configuration on the fake accelerator and on the CPU, or on a lent GPU
                  (``benchmarks/gpu.sh``); a spawned process
    report.py     the table and the findings
    cli.py        ``python -m twinshard.measure.fakeaccel``, ``twinshard bench --backend fakeaccel``
    __main__.py   ``python -m twinshard.measure.fakeaccel`` runs cli.py

The order of waits and events on the device, against the stand-in streams', is a benchmark:
``benchmarks/stream_order.py``; the hazards its tests plant live beside them
(``tests/support/fake_accelerator_hazards.py``).
"""

from twinshard.measure.fakedevice import BACKEND, DEVICE_TYPE, is_registered, register
from twinshard.measure.monitor import Monitor

from .runner import check, run

__all__ = ["BACKEND", "DEVICE_TYPE", "Monitor", "check", "is_registered", "register", "run"]
