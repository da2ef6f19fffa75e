"""twinshard.optimized with a parent of sharded modules sharded in pieces.

The same implementation as ``twinshard.optimized`` (its ``FSDPModule``, hooks and groups),
whose ``fully_shard`` cuts a parent's group where its sharded children cut its parameters:
the root of a Llama gathers its embedding first and its ``[norm, output]`` run when that run
starts forward, and reduces that run's gradients as soon as their backward ends ([Note: the
root's parameters in pieces] in ``pieces.py``); its first block is cut before the
feed-forward, so that neither end of the step waits for a whole block ([Note: the first block
in two pieces]). Name it wherever an implementation is named:
``twinshard bench --impls optimized,twinshard.optimized.in_pieces``, ``twinshard plan``,
``twinshard conform twinshard.optimized.in_pieces``, the switch.
"""

from __future__ import annotations

import torch.nn as nn

from twinshard.api import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    FSDPUsageError,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
)

from .fully_shard import FSDPModule, register_fsdp_forward_method, sharded, share_comm_ctx


def fully_shard(
    module: nn.Module,
    *,
    mesh=None,
    reshard_after_forward: bool | int | None = None,
    mp_policy=MixedPrecisionPolicy(),
    offload_policy=OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    shard_placement_fn=None,
    dp_mesh_dims=None,
) -> nn.Module:
    """``twinshard.optimized.fully_shard``, with a parent of sharded modules sharded in pieces."""
    return sharded(
        module,
        True,
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params=ignored_params,
        shard_placement_fn=shard_placement_fn,
        dp_mesh_dims=dp_mesh_dims,
    )


__all__ = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "FSDPUsageError",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
