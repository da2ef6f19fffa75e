"""The fake-accelerator checks on a real accelerator, for the day one is lent.

``benchmarks/gpu.sh`` runs ``runner.check(config, on="cuda")``, which comes here: the same
configuration, model and steps as on the fake accelerator, with real tensors on the device and
PyTorch's fake process group registered for the device alone (``device.join``), so that one
GPU plays rank 0 of a world of W ranks, and a host tensor in a collective fails as on NCCL.
The same ``monitor.Monitor`` counts host syncs, host tensors in collectives, collectives and
bytes, and the steps run under the device module's sync debug mode (``"error"``: CUDA's own
check, which raises at the first operator that waits for the device), so a sync that the
monitor cannot see (inside a C++ kernel) still fails the run.

The model is built on the host from the seed and moved to the device before sharding, as
``twinshard bench`` does on a GPU (with offload it stays on the host, as FSDP2 asks).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from twinshard.bench.config import RunConfig, build
from twinshard.bench.probe import Probe, sharded_modules

from . import device as fake_device
from .monitor import Monitor, Phase


def device_run(config: RunConfig, steps: int, device_type: str, planted=None) -> list[Phase]:
    """``steps`` training steps of ``config`` on the real ``device_type`` (see the module
    docstring); the monitor's phases (setup first)."""
    from .runner import batch_shape, plant_hazard, train_step

    module = torch.get_device_module(device_type)
    if device_type == "cpu" or not module.is_available():
        raise RuntimeError(
            f"twinshard.fakeaccel: no {device_type!r} device here; run the checks on the fake "
            "accelerator instead (on='fake', or --device fake)"
        )
    fake_device.join(config.world, device_type=device_type)
    device = torch.device(device_type, module.current_device())
    named = replace(config, backend=fake_device.backend_name(device_type))
    with Monitor(device_type) as monitor:
        model, opt = build(named, device)
        plant_hazard(planted, model)
        tokens = torch.randint(0, model.config.vocab_size, batch_shape(config), device=device)
        monitor.probe = Probe(model, opt, sharded_modules(model))
        debug = getattr(module, "set_sync_debug_mode", None)
        for k in range(steps):
            monitor.begin(f"step {k + 1}")
            if debug is not None:
                debug("error")
            try:
                train_step(model, opt, tokens)
            finally:
                if debug is not None:
                    debug(0)
            module.synchronize()
    return monitor.finish()
