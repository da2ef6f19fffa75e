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

from collections.abc import Callable
from enum import Enum, auto

import torch
import torch.nn as nn

from twinshard.api import CommHooks, MixedPrecisionPolicy, profiled, without_grad
from twinshard.guard import unused_grads

from . import more
from .collectives import all_gather_rows, all_reduce_sum, reduce_scatter_rows
from .mesh import MeshInfo
from .sharded_param import ParamState, ShardedParam


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
    ):
        self.params, self.info = params, info
        self.post_forward_info = post_forward  # None: keep unsharded after forward
        self.mp = mp
        self.device = info.device  # where compute happens
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
        return [self.mp.reduce_dtype or dtype for dtype in self.param_dtypes(params)]

    def gradient_divisors(self, dtype: torch.dtype, info: MeshInfo) -> tuple[float | None, float]:
        """What gradients reduced in ``dtype`` over ``info``'s ranks are divided by before the sum
        (None: not at all) and after it: in all ``set_gradient_divide_factor``'s factor, else the
        ranks (a mean); an fp16 sum is split around, as torch's (second reading: ``more/fp16.py``)."""
        factor = self.divide_factor or info.shard_size * info.replicate_size
        return (
            (None, factor)
            if dtype in (torch.float32, torch.bfloat16)
            else more.fp16_divisors(factor)
        )

    # --- unshard / reshard ----------------------------------------------------------------------
    @without_grad
    def unshard(self, meanwhile: Callable[[], None] | None = None) -> None:
        """All-gather every parameter of the group (a no-op for those already unsharded), then
        run ``meanwhile``: the contract's seam for "issue now, wait later", a step due before
        the group computes that an implementation issuing and waiting apart may run in between
        (the hooks pass their state's ``while_gathering``: None here)."""
        with profiled("twinshard::unshard"):
            for p, dtype in zip(self.params, self.param_dtypes(self.params)):
                self.unshard_param(p, dtype)
        if meanwhile is not None:
            meanwhile()

    def unshard_param(self, p: ShardedParam, dtype: torch.dtype) -> None:
        """The contract's unshard steps for one parameter: an all-gather per input (one block
        for a plain parameter) into the unsharded parameter, which then goes on the module."""
        if p.state is ParamState.UNSHARDED:
            return
        group = p.all_gather_mesh(self.post_forward_info).shard_group
        blocks = p.all_gather_inputs(dtype)  # [(chunk, *rest)], or an extension's inputs
        for block, out in zip(blocks, p.all_gather_outputs(dtype)):  # out: (S * chunk, *rest)
            all_gather_rows(out, block, group, comm=self.comms.all_gather, about=p.fqn)
        p.finish_unshard()

    @without_grad
    def reshard(self, after_forward: bool = False) -> None:
        """Free the unsharded parameters; after forward, an int setting keeps a 1/N piece."""
        with profiled("twinshard::reshard"):
            for p in self.params:  # one on a mesh of its own (shard_placement_fn) reshards fully
                p.reshard(self.post_forward_info if after_forward and p.info is self.info else None)

    # --- forward: unshard before, reshard after ---------------------------------------------------
    def pre_forward(self, meanwhile: Callable[[], None] | None = None) -> None:
        self.state = TrainingState.FORWARD
        self.unshard(meanwhile)

    def post_forward(self) -> None:
        if self.post_forward_info is not None:
            self.reshard(after_forward=True)
        self.state = TrainingState.IDLE

    # --- backward: unshard before, reshard and reduce after ------------------------------------------
    def pre_backward(self, meanwhile: Callable[[], None] | None = None) -> None:
        if self.state is TrainingState.PRE_BACKWARD:
            return  # one output's hook already did it
        self.state = TrainingState.PRE_BACKWARD
        if self.unshard_in_backward:
            with profiled("twinshard::pre_backward"):
                self.unshard(meanwhile)
        elif meanwhile is not None:
            meanwhile()  # nothing of this group's to gather; the step still runs

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
        """Reduce each waiting gradient, one by one. Every trainable parameter takes part, with
        zeros where this rank computed no gradient, so that all ranks issue the same
        collectives and keep the same sums (second reading: ``more/usage.py``)."""
        for p, dtype in zip(self.params, self.reduce_dtypes(self.params)):
            used = self.reduce_param(p, dtype)
            if used is not None:
                self.usage[p] = used

    def reduce_param(self, p: ShardedParam, dtype: torch.dtype) -> bool | None:
        """The contract's reduce steps for one parameter: reduce-scatter its waiting gradient
        (for HSDP, all-reduce it across the replicas), then add this rank's block, divided into
        the mean, to the sharded gradient. Returns whether this rank had a gradient (None for a
        frozen parameter, which takes no part)."""
        before, after = self.gradient_divisors(dtype, p.info)
        used = p.has_grad_to_reduce
        grad = p.reduce_scatter_input(dtype)  # (S * chunk, *rest), zeros if unused here
        if grad is None:
            return None
        grad = grad.to(dtype)  # reduced in the reduce dtype
        if before is not None:
            grad.div_(before)  # fp16: a sum of N gradients must not overflow
        group, comm = p.info.shard_group, self.comms.reduce_scatter  # p's mesh, as each one
        block = reduce_scatter_rows(grad, group, comm, p.fqn)  # (chunk, *rest) summed
        if p.info.replicate_group is not None:
            block = p.combine_partial_sum(block, self.all_reduce_grads)
            if block is None:
                return used  # summed over the shard group only, for now
            all_reduce_sum(block, p.info.replicate_group, p.fqn)
        if self.comms.all_reduce_hook is not None:
            self.comms.all_reduce_hook(block)  # the user's hook, in place, once per parameter
        unused_grads.note_reduced(p, used or self.reduce_unused)  # kept if some rank used it
        p.accumulate_grad(block / after)  # (chunk, *rest): the sum becomes the mean
        return used

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

    def modules_with_params(self) -> set[nn.Module]:
        """Every module that holds one of the group's parameters."""
        return {m for p in self.params for m, _ in p.owners}
