"""Where the collectives' buffers come from: torch's two switches for NCCL's own memory.

Torch offers both only through private names (a process group's ``_get_backend``, the module
``torch.distributed._symmetric_memory``), the ones its ``fully_shard`` uses; they are reached
here, in one place outside the implementations, so an implementation (the optimized path)
uses only these classes.

A group's flat buffers (the all-gather's output, whose slot is its input; the packed gradients
and the reduce-scatter's output) come from the caching allocator. Two of ``FSDPModule``'s
switches ask for memory the communication library can use without staging copies, as torch's
``fully_shard`` has them:

- ``set_allocate_memory_from_process_group_for_comm(True)``: ``ProcessGroupMemory`` asks the
  process group's backend for each buffer (``allocate_tensor``; NCCL registers it for
  zero-copy transfers) where the backend can allocate on that device;
- ``set_symm_mem_for_comm()``: ``SymmetricMemory`` takes the buffers from the symmetric-memory
  pool of the device (CUDA) and makes each known to every rank (``rendezvous``) as it is
  allocated: every rank allocates the same buffers in the same order, so the rendezvous match
  (torch's ``fully_shard`` makes them before each collective, which its pool's reuse of
  buffers needs). NCCL may then run its symmetric-memory kernels. The reduce-scatter uses it
  only with ``set_force_sum_reduction_for_comms(True)``: NCCL's symmetric reduce-scatter sums
  only.

Where the backend or the device offers no such memory (gloo, the CPU), the buffers come from
the caching allocator as without the switch, and a warning says so once per switch and
backend. The values reduced and gathered are the same either way.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist

WARNED: set[tuple] = set()  # (switch, backend): warned once in this process


def warn_once(switch: str, backend: str, why: str) -> None:
    """Say once per process that ``switch`` has no effect on ``backend``, and why."""
    if (switch, backend) in WARNED:
        return
    WARNED.add((switch, backend))
    warnings.warn(
        f"{switch}: {why}; the communication buffers come from the caching allocator, as "
        "without it",
        stacklevel=3,
    )


class ProcessGroupMemory:
    """Buffers from the process group's backend (``set_allocate_memory_from_process_group_for
    _comm``), with torch's ``Comm.allocate`` signature."""

    switch = "set_allocate_memory_from_process_group_for_comm"

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.allocates: dict[torch.device, bool] = {}  # per device: whether the backend can

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """A flat buffer of ``size`` from the backend, or None where it allocates none on
        ``device`` (the caller's own allocation then stands)."""
        backend = self.group._get_backend(device)  # what runs the group's collectives there
        if device not in self.allocates:
            self.allocates[device] = bool(backend.supports_tensor_alloc(device))
            if not self.allocates[device]:
                name = dist.get_backend(self.group)
                warn_once(self.switch, name, f"the {name} backend allocates no tensors")
        if not self.allocates[device]:
            return None
        numel = math.prod(int(n) for n in size)
        return backend.allocate_tensor(numel, dtype=dtype, device=device)


class SymmetricMemory:
    """Buffers from the device's symmetric-memory pool (``set_symm_mem_for_comm``)."""

    switch = "set_symm_mem_for_comm"
    devices = ("cuda",)  # where the pool exists (with the nccl backend)

    def __init__(self, group: dist.ProcessGroup, backend: str = "NCCL"):
        self.group, self.backend = group, backend
        self.ready: dict[torch.device, bool] = {}  # per device: whether the pool is there

    def usable(self, device: torch.device) -> bool:
        if device not in self.ready:
            name = dist.get_backend(self.group)
            self.ready[device] = device.type in self.devices and name == "nccl"
            if self.ready[device]:
                import torch.distributed._symmetric_memory as symm_mem

                symm_mem.set_backend(self.backend)
                dist.barrier(group=self.group)  # the communicator exists before a rendezvous
            else:
                warn_once(self.switch, name, f"{name} on {device.type} has no symmetric memory")
        return self.ready[device]

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """A flat buffer of ``size`` from the pool, known to every rank of the group; None
        where there is no pool."""
        if not self.usable(device):
            return None
        import torch.distributed._symmetric_memory as symm_mem

        with torch.cuda.use_mem_pool(symm_mem.get_mem_pool(device)):
            buffer = torch.empty(size, dtype=dtype, device=device)
        symm_mem.rendezvous(buffer, group=self.group.group_name)
        return buffer
