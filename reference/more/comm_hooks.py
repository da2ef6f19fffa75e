"""Second reading. The user's own collectives: ``set_custom_all_gather``, ``..._reduce_scatter``.

torch's ``FSDPModule.set_custom_all_gather(comm)`` and ``set_custom_reduce_scatter(comm)`` hand
FSDP an object that runs the collective instead of ``torch.distributed`` (a symmetric-memory
or a quantized one, say), called with the keywords of torch's ``AllGather`` and
``ReduceScatter`` interfaces, and asked to allocate the tensors it writes. The reference calls
it once per parameter, where ``collectives.py`` would call torch's, and waits for it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from twinshard.api import profiled


def user_all_gather(comm, out: torch.Tensor, block: torch.Tensor, group) -> None:
    """All-gather ``block`` (chunk, *rest) into ``out`` (S * chunk, *rest) with ``comm``."""
    wait(comm(output_tensor=out, input_tensor=block, group=group))


def user_reduce_scatter(comm, full: torch.Tensor, group, shape: tuple) -> torch.Tensor:
    """Reduce-scatter ``full`` (S * chunk, *rest) with ``comm`` into a block of ``shape``
    (chunk, *rest) that ``comm`` allocates, and return the block."""
    out = comm.allocate(shape, dtype=full.dtype, device=full.device)
    with profiled("twinshard::reduce_scatter"):
        wait(
            comm(
                output_tensor=out, input_tensor=full.contiguous(), group=group, op=dist.ReduceOp.SUM
            )
        )
    return out


def wait(work) -> None:
    """A user's collective may hand back a work handle even when asked to block: wait on it."""
    if work is not None:
        work.wait()
