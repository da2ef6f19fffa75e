"""The parameters of one ``fully_shard`` call and what happens to them in a training step.

A step, seen from one parameter group (one transformer block, say):

    pre_forward     all-gather every parameter (unshard)          forward runs on full weights
    post_forward    free them again (reshard), unless told to keep them
    pre_backward    all-gather again: backward needs the weights too
    post_backward   reduce-scatter the gradients into sharded DTensor gradients, free weights

Each hook has its twin right below it. The reference issues the collectives one parameter
at a time and waits for each; the optimized implementation batches and overlaps them.
"""

from __future__ import annotations

from enum import Enum, auto

import torch
import torch.nn as nn

from twinshard.api import CommHooks, MixedPrecisionPolicy, profiled, without_grad

from .mesh import MeshInfo
from .sharded_param import ShardedParam


class TrainingState(Enum):
    IDLE = auto()  # between steps, or between forward and backward
    FORWARD = auto()  # inside this group's forward
    PRE_BACKWARD = auto()  # backward through this group's modules has started
    POST_BACKWARD = auto()  # this group's gradients were reduced in this backward


class ParamGroup:
    """Unshards, reshards and reduces one group's parameters, one parameter at a time."""

    def __init__(
        self,
        params: list[ShardedParam],
        info: MeshInfo,
        post_forward: MeshInfo | None,
        mp: MixedPrecisionPolicy,
        device: torch.device,
    ):
        self.params = params
        self.info = info
        self.post_forward_info = post_forward  # None: keep unsharded after forward
        self.mp = mp
        self.device = device
        self.state = TrainingState.IDLE
        self.reduce_grads = True  # set_requires_gradient_sync
        self.all_reduce_grads = True  # set_requires_all_reduce (HSDP)
        self.reshard_after_backward = True  # set_reshard_after_backward
        self.unshard_in_backward = True  # set_unshard_in_backward
        self.reduce_unused = False  # set_reduce_scatter_unused_params
        self.divide_factor: float | None = None  # set_gradient_divide_factor
        self.comms = CommHooks()  # set_custom_all_gather, set_custom_reduce_scatter, ...
        self.usage: dict[ShardedParam, bool] = {}  # this backward: which params had gradients

    # --- dtypes -------------------------------------------------------------------------------
    def param_dtypes(self, params: list[ShardedParam]) -> list[torch.dtype]:
        """The compute dtype of each of ``params``: the policy's ``param_dtype``, else its own."""
        return [self.mp.param_dtype or p.sharded_param.dtype for p in params]

    def reduce_dtypes(self, params: list[ShardedParam]) -> list[torch.dtype]:
        """The gradient reduction dtype of each of ``params``: the policy's ``reduce_dtype``,
        else the compute dtype."""
        if self.mp.reduce_dtype is not None:
            return [self.mp.reduce_dtype] * len(params)
        return self.param_dtypes(params)

    def gradient_divisors(self, dtype: torch.dtype) -> tuple[float | None, float]:
        """What gradients reduced in ``dtype`` are divided by before the sum and after it:
        together ``set_gradient_divide_factor``'s factor, else the number of data-parallel ranks
        (the sum over ranks becomes their mean). fp32 and bf16 have range to spare, so the sum
        is divided once, after. In fp16 the sum of N gradients can overflow where their mean
        would not, so each gradient is first divided by the smallest power of two whose square
        reaches the factor (a power of two only moves the exponent: no rounding), the sum by the
        rest: the same split as torch's ``fully_shard``."""
        factor = self.divide_factor or self.info.shard_size * self.info.replicate_size
        if dtype in (torch.float32, torch.bfloat16):
            return None, factor
        before = 1
        while before * before < factor:
            before *= 2
        return float(before), factor / before

    # --- unshard / reshard ----------------------------------------------------------------------
    @without_grad
    def unshard(self) -> None:
        """All-gather every parameter of the group (a no-op for those already unsharded)."""
        with profiled("twinshard::unshard"):
            for p, dtype in zip(self.params, self.param_dtypes(self.params)):
                p.unshard(dtype, self.post_forward_info, self.comms.all_gather)

    @without_grad
    def reshard(self, after_forward: bool = False) -> None:
        """Free the unsharded parameters; after forward, an int setting keeps a 1/N piece."""
        with profiled("twinshard::reshard"):
            for p in self.params:
                p.reshard(self.post_forward_info if after_forward else None)

    # --- forward: unshard before, reshard after ---------------------------------------------------
    def pre_forward(self) -> None:
        self.state = TrainingState.FORWARD
        self.unshard()

    def post_forward(self) -> None:
        if self.post_forward_info is not None:
            self.reshard(after_forward=True)
        self.state = TrainingState.IDLE

    # --- backward: unshard before, reshard and reduce after ------------------------------------------
    def pre_backward(self) -> None:
        if self.state is TrainingState.PRE_BACKWARD:
            return  # one output's hook already did it
        self.state = TrainingState.PRE_BACKWARD
        if self.unshard_in_backward:
            with profiled("twinshard::pre_backward"):
                self.unshard()

    @without_grad
    def post_backward(self) -> None:
        """Reshard and reduce this group's gradients; safe to call when nothing was computed.
        The parameters are freed before the reduction: once their gradients are taken nothing
        reads them, and the reduction's buffers then never sit beside the unsharded weights."""
        self.state = TrainingState.POST_BACKWARD
        with profiled("twinshard::post_backward"):
            for p, dtype in zip(self.params, self.reduce_dtypes(self.params)):
                p.take_grad(dtype)
            if self.reshard_after_backward:
                self.reshard()
            if self.reduce_grads:
                self.reduce_grads_now()

    def reduce_grads_now(self) -> None:
        """Reduce-scatter (and for HSDP all-reduce) each waiting gradient, one by one. Every
        trainable parameter takes part, with zeros where this rank computed no gradient, so
        that all ranks issue the same collectives (see ``usage.py``)."""
        for p, dtype in zip(self.params, self.reduce_dtypes(self.params)):
            used = p.reduce_grad(
                dtype,
                self.gradient_divisors(dtype),
                self.all_reduce_grads,
                self.comms,
                self.reduce_unused,
            )
            if used is not None:
                self.usage[p] = used

    def reset(self) -> None:
        """After an aborted iteration: free the unsharded parameters, drop every gradient not
        yet reduced, and go back to idle."""
        self.reshard()
        for p in self.params:
            p.discard_grads()
        self.usage.clear()
        self.state = TrainingState.IDLE

    def finish_backward(self) -> None:
        """End of the whole backward: groups whose inputs needed no gradient never got their
        post-backward call from autograd, so it runs here; then every group is idle again."""
        if self.state is not TrainingState.POST_BACKWARD and any(
            p.has_new_grad for p in self.params
        ):
            self.post_backward()
        elif self.reshard_after_backward:
            self.reshard()  # parameters that got no gradient are still freed
        self.state = TrainingState.IDLE

    def grad_copies_in_flight(self) -> bool:
        """Whether gradients were copied to pinned host memory without waiting (CPU offload)
        since the last call; the root then waits for the device once."""
        if not self.params or not self.params[0].pin:  # one offload policy per group
            return False
        found = any([p.grad_in_flight for p in self.params])
        for p in self.params:
            p.grad_in_flight = False
        return found

    def modules_with_params(self) -> set[nn.Module]:
        """Every module that holds one of the group's parameters."""
        return {m for p in self.params for m, _ in p.owners}
