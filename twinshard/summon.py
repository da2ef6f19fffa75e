"""``summon_full_params``: FSDP1's context manager for looking at (and editing) whole parameters,
for any FSDP2-style module: twinshard's reference and optimized paths and torch's fully_shard.

FSDP2's ``unshard()`` gathers the parameters in the compute dtype, and whatever is written
into them is lost at the next ``reshard()``. Inside ``summon_full_params(model)`` each sharded
parameter (a ``DTensor``) is replaced on its module by a plain ``nn.Parameter`` holding the
whole tensor in the shard's own dtype (``DTensor.full_tensor()``: an all-gather). On exit,
with ``writeback=True``, each rank copies its own rows of the (possibly edited) whole tensor
back into its shard (``distribute_tensor(..., src_data_rank=None)`` slices locally, without
communication), and the sharded parameters are put back: the same objects, so the optimizer
and FSDP keep working with them.

Every rank must enter the context (the gather is a collective). Run no forward or backward
inside it. Options as in FSDP1: ``rank0_only`` (only rank 0 gets whole tensors; no
writeback), ``offload_to_cpu``, ``with_grads`` (the whole gradients too), ``recurse`` (False:
only the parameters this module's own ``fully_shard`` call manages, not its sharded children's).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from twinshard.api import FSDPUsageError


def _own_params(module: nn.Module, recurse: bool) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """(owner, attribute, parameter) of every sharded parameter to summon, each once."""
    found, seen = [], set()
    todo = [module]
    while todo:
        m = todo.pop()
        for name, p in m._parameters.items():
            if isinstance(p, DTensor) and id(p) not in seen:
                seen.add(id(p))
                found.append((m, name, p))
        for child in m._modules.values():
            if child is not None and (recurse or not isinstance(child, TorchFSDPModule)):
                todo.append(child)
    return found


@contextlib.contextmanager
def summon_full_params(
    module: nn.Module,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
):
    """Whole parameters on ``module`` (and below) inside the context; see the module docstring."""
    if rank0_only and writeback:
        raise FSDPUsageError(
            "summon_full_params: rank0_only=True cannot write back (the other ranks hold no "
            "whole tensors); pass writeback=False"
        )
    for m in module.modules():
        if isinstance(m, TorchFSDPModule):
            m.reshard()  # the sharded parameters are the ones registered
    params = _own_params(module, recurse)
    keep = not rank0_only or dist.get_rank() == 0
    whole = []
    with torch.no_grad():
        for owner, name, p in params:
            full = p.full_tensor()  # an all-gather, in the shard's dtype
            grad = p.grad.full_tensor() if with_grads and p.grad is not None else None
            if offload_to_cpu:
                full = full.cpu()
                grad = grad.cpu() if grad is not None else None
            summoned = nn.Parameter(full, requires_grad=p.requires_grad)
            summoned.grad = grad
            whole.append(summoned)
            if keep:
                owner._parameters[name] = summoned
    try:
        yield module
    finally:
        with torch.no_grad():
            for (owner, name, p), summoned in zip(params, whole):
                owner._parameters[name] = p  # the same sharded parameter as before
                if writeback:
                    full = summoned.detach().to(p.device, p.dtype)
                    local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
                    p.to_local().copy_(local.to_local())
                    if with_grads and summoned.grad is not None and p.grad is not None:
                        g = summoned.grad.to(p.device, p.dtype)
                        g = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
                        p.grad.to_local().copy_(g.to_local())
