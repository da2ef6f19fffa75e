"""torchtitan's own trainer (``python -m torchtitan.train``) on a CPU-only machine: the shim.

Run it where you would run ``-m torchtitan.train``, with the same arguments:

    torchrun --nproc-per-node 2 -m twinshard.run --impls optimized tests/support/torchtitan_on_cpu.py \\
        --job.config_file job.toml

It changes none of torchtitan's files. It imports ``torchtitan.train`` with one module that
needs triton stood in for, points every torchtitan module that bound the device at the CPU,
and calls ``torchtitan.train.main(Trainer)``, as ``python -m torchtitan.train`` does. Each
line says what it works around and why that is not twinshard's business; none of it is
needed on GPUs (docs/clients.md). It applies to every implementation alike, except the
lines marked torch only, which make torch's own ``fully_shard`` train on gloo at all.
"""

from __future__ import annotations

import os
import sys
import types

import torch
from torch.distributed.fsdp import FSDPModule

from twinshard import switch


def _cpu_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# torch.cpu as torchtitan's "device module", with the memory-statistics calls its
# DeviceMemoryMonitor makes (torch.cpu has none of them): a CPU build of torch, not FSDP.
CPU_DEVICE_MODULE = types.SimpleNamespace(
    set_device=torch.cpu.set_device,  # the trainer's device_module.set_device(cpu:LOCAL_RANK)
    current_device=lambda: 0,  # an int, as torch.cuda's: it goes to barrier(device_ids=[...])
    synchronize=torch.cpu.synchronize,  # a no-op on the CPU, as torch.cpu's
    get_device_name=lambda device=None: "cpu",  # logged, and looked up in a table of peak FLOPS
    get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=_cpu_memory()),
    memory_stats=lambda device=None: {},  # no CUDA caching allocator: peaks logged as -1
    reset_peak_memory_stats=lambda device=None: None,  # nothing to reset on the CPU
    empty_cache=lambda: None,  # no caching allocator to empty on the CPU
)


def _needs_triton(*args, **kwargs):
    raise ModuleNotFoundError("torchtitan's MoE permutation kernel needs triton (tests/ shim)")


# What torchtitan.models.moe.kernels exports, without the triton its kernel is written in.
NO_TRITON_KERNELS = types.ModuleType("torchtitan.models.moe.kernels")
NO_TRITON_KERNELS.generate_permute_indices = NO_TRITON_KERNELS.fill_indices_wrapper = _needs_triton


def apply() -> types.ModuleType:
    """Import torchtitan's trainer pointed at the CPU; on torch's own fully_shard, force sum
    reductions (gloo has no PREMUL_SUM). Returns ``torchtitan.train``."""
    # torchtitan imports triton (not in its metadata; a CPU build of torch has none) when the
    # package is imported, for its MoE token-permutation kernel, which the dense Llama never
    # calls: that one module (moe/kernels.py) is replaced by one whose kernel raises. Not FSDP's.
    sys.modules["torchtitan.models.moe.kernels"] = NO_TRITON_KERNELS
    import torchtitan.train as titan_train

    # torchtitan hard-wires its device: `_get_available_device_type() or "cuda"` in
    # tools/utils.py, bound at import by metrics, parallel_dims, distributed/utils and
    # profiling; without an accelerator that is "cuda", which a CPU build cannot use, and the
    # test trains on gloo ranks of the CPU wherever it runs. A device choice, not FSDP's.
    for module in [m for name, m in sys.modules.items() if name.startswith("torchtitan.")]:
        if getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
        if getattr(module, "device_module", None) is torch.cuda:
            module.device_module = CPU_DEVICE_MODULE
    if switch.active() == "torch":
        # Torch only: torchtitan sets each FSDPModule's gradient divide factor to 1.0, for which
        # torch's fully_shard picks ReduceOp.PREMUL_SUM, which gloo refuses; with sum reductions
        # forced torch reduce-scatters with SUM and divides by 1.0 (the same numbers). twinshard
        # reduces with SUM on gloo by itself; this is torch's gap on gloo, not twinshard's.
        set_divide_factor = FSDPModule.set_gradient_divide_factor

        def set_divide_factor_and_force_sum(self, factor: float) -> None:
            set_divide_factor(self, factor)
            self.set_force_sum_reduction_for_comms(True)

        FSDPModule.set_gradient_divide_factor = set_divide_factor_and_force_sum
    return titan_train


if __name__ == "__main__":
    titan_train = apply()
    titan_train.main(titan_train.Trainer)  # what `python -m torchtitan.train` runs
