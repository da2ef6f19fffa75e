"""Gradient clipping over the local shards of FSDP's ``DTensor`` gradients, bitwise torch's.

``clip_grad_norm_(parameters, max_norm)`` takes the arguments of
``torch.nn.utils.clip_grad_norm_`` and gives the same gradients, bit for bit, and the same
total norm. Where every gradient is a ``DTensor`` of one dtype on one mesh, sharded over the
same mesh dimension (FSDP on a 1-D mesh, HSDP on a 2-D one) or over none, it computes on the
local shards directly; anything else goes to torch's own function.

[Note: the gradient norm over local shards]
torch's ``clip_grad_norm_`` over FSDP2's gradients runs each of its operations through
``DTensor``'s dispatch in Python: the per-gradient norms, their stack, the total, the
coefficient and the scaling. What the dispatch decides is always the same for such gradients:
each local norm is a partial norm over the shard dimension, reduced as ``x**p``, a sum over the
shard group, ``x**(1/p)`` (``max`` for the infinity norm). This module runs those same kernels
on the local tensors and makes that one all-reduce itself; torch makes it too (when the
coefficient needs the total) and again when the caller asks for the total with
``full_tensor()``, which here finds it replicated already. Nothing reads a device value on the
host, unless ``error_if_nonfinite`` asks (one read, as torch's).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


def clip_grad_norm_(
    parameters,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Scale the gradients of ``parameters`` so that their total norm is at most
    ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does, and return the total norm (a
    ``DTensor`` replicated over the gradients' mesh, where it computed on local shards)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    norm_type = float(norm_type)
    dim = _shard_dim(grads)
    if dim is False or norm_type in (0.0, -math.inf):
        return torch.nn.utils.clip_grad_norm_(
            params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach
        )
    with torch.no_grad():
        local = [g._local_tensor for g in grads]  # to_local() would make autograd views
        if foreach is False:
            norms = [torch.linalg.vector_norm(g, norm_type) for g in local]
        else:
            norms = torch._foreach_norm(local, norm_type)
        stacked = torch.stack(norms)
        mesh = grads[0].device_mesh
        group = None if dim is None else mesh.get_group(dim)
        if group is not None and norm_type == 1.0:  # each gradient's norm summed first
            dist.all_reduce(stacked, group=group)
        total = torch.linalg.vector_norm(stacked, norm_type)
        if group is not None and norm_type == math.inf:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        elif group is not None and norm_type != 1.0:
            total = total**norm_type
            dist.all_reduce(total, group=group)
            total = total ** (1.0 / norm_type)
        if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
            raise RuntimeError(
                f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
                "non-finite, so it cannot be clipped; pass error_if_nonfinite=False to scale "
                "them by it anyway"
            )
        coefficient = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        if foreach is False:
            for g in local:
                g.mul_(coefficient)
        else:
            torch._foreach_mul_(local, coefficient)
    replicated = [Replicate()] * mesh.ndim
    return DTensor.from_local(total, mesh, replicated, run_check=False)


def _shard_dim(grads: list) -> int | None | bool:
    """The mesh dimension every gradient is sharded over (None: none is), or False where the
    local path does not apply: no gradients, a plain tensor, more than one mesh, dtype or
    device, a partial placement, or more than one sharded dimension. Sets over the gradients,
    not a loop: the gradients of one FSDP module share a handful of layouts."""
    if not grads or set(map(type, grads)) != {DTensor}:
        return False
    specs = [g._spec for g in grads]  # the public properties would build each one again
    if len({id(spec.mesh) for spec in specs}) > 1 or len({(g.dtype, g.device) for g in grads}) > 1:
        return False
    sharded = set()
    for placements in {spec.placements for spec in specs}:
        if any(placement.is_partial() for placement in placements):
            return False
        sharded.add(tuple(i for i, placement in enumerate(placements) if placement.is_shard()))
    if len(sharded) > 1 or len(next(iter(sharded))) > 1:
        return False
    return next(iter(next(iter(sharded))), None)
