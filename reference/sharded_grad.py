"""The gradient half of ``ShardedParam``: from autograd's unsharded ``.grad`` to this rank's
block of the sharded ``DTensor`` gradient (see the contract in ``sharded_param.py``).

A backward leaves a whole-parameter gradient, (rows, *rest), on every rank. ``take_grad`` adds
it to the sum waiting to be reduced (several backwards may add up before one reduction, with
``set_requires_gradient_sync(False)``). ``reduce_grad`` pads it to S * chunk rows,
reduce-scatters it (rank r receives the sum of block r), for HSDP adds what earlier backwards
kept back and all-reduces over the replicas, then divides by the number of ranks and adds the
result to the sharded gradient: the mean gradient, sharded like the parameter.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from twinshard.api import CommHooks
from twinshard.guard import check_collective

from .collectives import all_reduce_sum, pad_rows, reduce_scatter_rows


class GradientPath:
    """The gradient methods of ``ShardedParam`` (which also holds the attributes they use)."""

    grad_in_flight = False  # offload: a copy to host memory not yet waited for (``to_host``)

    @property
    def has_new_grad(self) -> bool:
        """Whether autograd wrote an unsharded ``.grad`` that ``take_grad`` has not taken."""
        return self.unsharded_param is not None and self.unsharded_param.grad is not None

    def take_grad(self, reduce_dtype: torch.dtype) -> None:
        """Move autograd's unsharded ``.grad`` into the sum waiting to be reduced."""
        grad = self.unsharded_param.grad if self.unsharded_param is not None else None
        if grad is None:  # with tensor parallelism a DTensor, of which we take our piece
            return
        if self.tp is not None:
            grad = grad.to_local()
        if hasattr(grad, "__tensor_flatten__"):  # a subclass: collectives move plain tensors
            grad = torch.empty(grad.shape, dtype=reduce_dtype, device=self.device).copy_(grad)
        grad = grad.to(dtype=reduce_dtype)  # (rows, *rest)
        self.unsharded_param.grad = None
        if self.grad_to_reduce is None:
            self.grad_to_reduce = grad
        else:
            self.grad_to_reduce += grad

    def reduce_grad(
        self, dtype: torch.dtype, divisors: tuple, all_reduce: bool, comms: CommHooks, keep_unused
    ) -> bool | None:
        """Reduce-scatter the waiting gradient (and all-reduce it across HSDP replicas), then
        add this rank's block to the sharded ``DTensor`` gradient. ``divisors``: what to divide
        by before the sum (None: nothing) and after it (``ParamGroup.gradient_divisors``).
        Returns whether this rank had a gradient (None for a frozen parameter, which takes no
        part)."""
        before, after = divisors
        used = self.has_grad_to_reduce
        grad = self.reduce_scatter_input(dtype)  # (S * chunk, *rest), zeros if unused here
        if grad is None:
            return None
        if before is not None:
            grad.div_(before)  # fp16: a sum of N gradients must not overflow
        check_collective("reduce_scatter", grad, self.info.shard_group, self.fqn)
        block = reduce_scatter_rows(grad, self.info.shard_group, comms.reduce_scatter)
        if self.info.replicate_group is not None:  # block: (chunk, *rest) summed
            block = self.combine_partial_sum(block, all_reduce)
            if block is None:
                return used  # summed over the shard group only, for now
            check_collective("all_reduce", block, self.info.replicate_group, self.fqn)
            all_reduce_sum(block, self.info.replicate_group)
        if comms.all_reduce_hook is not None:
            comms.all_reduce_hook(block)  # the user's hook, in place, once per parameter here
        if used or keep_unused:
            self.accumulate_grad(block / after)  # the sum over ranks becomes their mean
        return used

    @property
    def has_grad_to_reduce(self) -> bool:
        """Whether a gradient from this rank's backward waits to be reduced."""
        return self.grad_to_reduce is not None

    def reduce_scatter_input(self, dtype: torch.dtype) -> torch.Tensor | None:
        """Hand over the waiting gradient, padded to (S * chunk, *rest). A trainable parameter
        with no gradient here hands over zeros of ``dtype`` (every rank must send the same
        amount, whichever parameters it used); a frozen one hands over None."""
        rows = self.info.shard_size * self.chunk
        if self.grad_to_reduce is None:
            if (
                not self.sharded_param.requires_grad
                or self.info.shard_size * self.info.replicate_size == 1
            ):
                return None  # frozen, or alone: nothing to keep in step with
            return torch.zeros((rows, *self.block_shape[1:]), dtype=dtype, device=self.device)
        grad = pad_rows(self.rows_first(self.grad_to_reduce), rows)  # (S * chunk, *rest)
        self.grad_to_reduce = None
        return grad.contiguous()

    def combine_partial_sum(self, block: torch.Tensor, all_reduce: bool) -> torch.Tensor | None:
        """HSDP: add to ``block`` (chunk, *rest), in place, what earlier backwards reduce-scattered
        without all-reducing. Returns the block to all-reduce now, or None when ``all_reduce``
        is False: then the sum is kept for the next backward instead."""
        if self.partial_sum is not None:
            block += self.partial_sum  # (chunk, *rest)
            self.partial_sum = None
        if not all_reduce:
            self.partial_sum = block
            return None
        return block

    def accumulate_grad(self, block: torch.Tensor) -> None:
        """Add a reduced block (chunk, *rest) to the sharded ``DTensor`` gradient, dropping the
        padding rows and moving it to the shard's dtype and device."""
        if self.local_rows < self.chunk:  # (slicing costs a microsecond even when it keeps all)
            block = block[: self.local_rows]  # (local_rows, *rest)
        block = self.rows_first(block).to(dtype=self.sharded_param.dtype)  # (rows, *rest)
        if self.shard_device != self.device:  # offloaded
            block = self.to_host(block)
        if self.sharded_param.grad is None:
            # A gradient is laid out exactly like its parameter, so it takes the parameter's
            # spec as it is, through ``DTensor.__new__``: ``from_local`` (a new spec, checked) and
            # calling the class (its empty ``__init__`` sits behind a compiler guard) cost more.
            spec = self.sharded_param._spec  # mesh, placements, global shape, stride, dtype
            grad = DTensor.__new__(DTensor, block.contiguous(), spec, requires_grad=False)
            self.sharded_param.grad = grad
        else:
            self.sharded_param.grad.to_local().add_(block)
        # Autograd never accumulates into the sharded parameter, so it never runs the hooks
        # registered with register_post_accumulate_grad_hook: run them here, as torch's FSDP2
        # does (an optimizer stepped inside backward relies on them).
        for hook in (self.sharded_param._post_accumulate_grad_hooks or {}).values():
            hook(self.sharded_param)

    def to_host(self, block: torch.Tensor) -> torch.Tensor:
        """Copy a reduced block of an offloaded parameter to host memory. A new gradient goes
        to pinned memory without the host waiting (the root waits for all of them once, at the
        end of backward: ``ParamGroup.grad_copies_in_flight``); one added to an earlier
        gradient, or read by a hook right away, must be there first, so that copy waits."""
        hooks = self.sharded_param._post_accumulate_grad_hooks
        if not self.pin or self.sharded_param.grad is not None or hooks:
            return block.to(self.shard_device)
        self.grad_in_flight = True
        return block.to(self.shard_device, non_blocking=True)  # torch pins what it copies to

    def discard_grads(self) -> None:
        """Drop every gradient not yet reduced (after an aborted iteration)."""
        self.grad_to_reduce = self.partial_sum = None
        if self.unsharded_param is not None:
            self.unsharded_param.grad = None
