"""The ``FSDPModule`` contract: every method ``fully_shard`` adds to a module, documented once.

``fully_shard(module)`` changes ``type(module)`` to a new class that derives from an
implementation's ``FSDPModule`` (a subclass of this one) and from the module's original class,
so the module keeps its own methods and ``isinstance(module, twinshard.api.FSDPModule)`` holds
for every implementation. This class derives from torch's ``FSDPModule``, so
``isinstance(module, torch.distributed.fsdp.FSDPModule)`` holds too: libraries that detect
FSDP2 that way (accelerate, torchtitan, Lightning, torch's pipelining) treat a twinshard module
as what it is. Every public method of torch's class is defined here, so none of torch's
implementations (which reach into torch's own state) is ever called on a twinshard module.

Methods that raise ``NotImplementedError`` are the ones each implementation must provide. The
others are settings for an overlapped, multi-stream implementation on an accelerator: they are
checked here and accepted, and an implementation without overlap (the reference) ignores them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from twinshard.api import FSDPUsageError, UnshardHandle, check_fsdp_modules


@dataclass
class CommHooks:
    """Communication a user swapped in for one parameter group; None keeps the default.

    ``all_gather`` and ``reduce_scatter`` follow torch's ``AllGather`` / ``ReduceScatter``
    interface: ``allocate(size, dtype=, device=)`` and ``__call__(output, input, group,
    [op,] async_op=False)``. ``all_reduce_hook(reduced)`` runs on each reduced gradient (after
    the HSDP all-reduce), in place: before the division by the world size where one follows the
    sum, on the mean where the collectives take it (``set_all_reduce_hook``)."""

    all_gather: Any = None
    reduce_scatter: Any = None
    all_reduce_hook: Callable | None = None


def _must_implement(self) -> NotImplementedError:
    return NotImplementedError(f"{type(self).__name__} does not implement this FSDPModule method")


def _check_bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise FSDPUsageError(f"{where} takes a bool, got {value!r}")
    return value


class FSDPModule(TorchFSDPModule):
    """Methods that ``fully_shard`` adds to a module (see the module docstring)."""

    # --- communication on demand ---------------------------------------------------------
    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters so they are unsharded.

        With ``async_op=False`` the parameters are ready on return and ``None`` is returned.
        With ``async_op=True`` an ``UnshardHandle`` is returned; call its ``wait()`` before
        using the parameters. The next forward uses the unsharded parameters as they are.
        Calling it before the first forward does not make the module a root.
        """
        return self._fsdp_unshard(wait=not async_op)

    def _fsdp_unshard(self, wait: bool) -> UnshardHandle | None:
        """Implementation hook of ``unshard``: return ``None`` when ``wait`` else a handle."""
        raise _must_implement(self)

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones on the module again."""
        raise _must_implement(self)

    # --- gradient synchronization ---------------------------------------------------------
    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Whether backward reduces gradients across data-parallel ranks.

        ``False`` accumulates unsharded gradients locally (gradient accumulation without
        communication); the next backward with ``True`` reduces the sum. With ``recurse`` the
        setting applies to every FSDP module in this module's subtree.
        """
        raise _must_implement(self)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP only: whether backward all-reduces gradient shards across replicas.

        ``False`` still reduce-scatters within the shard group and keeps a partial sum;
        the next backward with ``True`` all-reduces everything accumulated.
        """
        raise _must_implement(self)

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """Whether a parameter that got no gradient on this rank (routing, a branch not taken)
        takes part in the reduction with zeros, so that its gradient is exact when other ranks
        used it. Without it, such a parameter is reported by name at the end of backward."""
        raise _must_implement(self)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the data-parallel world size."""
        raise _must_implement(self)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated by torch: the same as ``set_gradient_divide_factor``."""
        warnings.warn(
            "set_reduce_scatter_divide_factor is deprecated; use set_gradient_divide_factor",
            FutureWarning,
            stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last one before the optimizer step, so that
        an implementation can finish all outstanding gradient work at its end."""
        raise _must_implement(self)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce only with ``ReduceOp.SUM`` and divide after the sum, for this module's group
        (NCCL's zero-copy and symmetric-memory reductions take no other op). Without it, an
        implementation may have the collectives take the mean (``ReduceOp.AVG``) where torch's
        ``fully_shard`` does: the optimized path does; the reference always sums, so there it
        changes nothing."""
        _check_bool(enable, "set_force_sum_reduction_for_comms")

    # --- when parameters are freed and gathered ------------------------------------------------
    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` at run time (a bool)."""
        raise _must_implement(self)

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Whether parameters are freed after backward. ``False`` keeps them unsharded
        (useful between gradient-accumulation micro-batches); they are resharded by an explicit
        ``reshard()`` or a later backward with ``True``."""
        raise _must_implement(self)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether backward needs this module's parameters unsharded. ``False`` (for modules
        whose backward needs no weights, like an embedding's) skips the backward all-gather."""
        raise _must_implement(self)

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward: reshard everything, drop the
        collectives and gradient reductions in flight, and return every group to idle, so the
        next iteration runs normally. The failed iteration's gradients are lost. Call it on
        the root module."""
        raise _must_implement(self)

    # --- communication hooks ----------------------------------------------------------------
    def set_custom_all_gather(self, comm: Any) -> None:
        """Replace this group's all-gather by ``comm`` (torch's ``AllGather`` interface), e.g.
        a quantized one. The reference calls it once per parameter, the optimized path once
        per group."""
        raise _must_implement(self)

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Replace this group's reduce-scatter by ``comm`` (torch's ``ReduceScatter``)."""
        raise _must_implement(self)

    def set_all_reduce_hook(self, hook: Callable, *, stream: Any = None) -> None:
        """Call ``hook(reduced)`` on the reduced gradients (the reduce-scatter output, or the
        all-reduce output with HSDP), in place, before they are accumulated: the mean where the
        collectives take it (``ReduceOp.AVG``, as under torch), else the sum, which is divided
        afterwards."""
        raise _must_implement(self)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Let the process group's backend allocate this module's communication buffers (NCCL
        registers them for zero-copy transfers). The optimized path does; where the backend
        allocates no tensors (gloo) a warning says so once. The reference, whose collectives
        write straight into each parameter, accepts it and changes nothing."""
        _check_bool(enable, "set_allocate_memory_from_process_group_for_comm")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Take this module's communication buffers from the device's symmetric-memory pool
        (NCCL on CUDA), the reduce-scatter's only with ``set_force_sum_reduction_for_comms``.
        The optimized path does; elsewhere a warning says once that it changes nothing. The
        reference accepts it and changes nothing."""
        if backend != "NCCL":
            raise FSDPUsageError(f"set_symm_mem_for_comm supports backend 'NCCL', got {backend!r}")

    # --- scheduling hints -----------------------------------------------------------------
    def set_modules_to_forward_prefetch(self, modules: Iterable[FSDPModule]) -> None:
        """Modules whose all-gather is issued right after this module's, in forward.

        An implementation without overlap accepts and checks the list and otherwise ignores it:
        the reference is single-stream, so issuing an all-gather early would not overlap
        anything. The optimized implementation overrides this.
        """
        self._fsdp_forward_hint = check_fsdp_modules(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: Iterable[FSDPModule]) -> None:
        """Modules whose all-gather is issued right after this module's, in backward.

        Accepted and checked, and otherwise ignored by an implementation without overlap
        (see ``set_modules_to_forward_prefetch``).
        """
        self._fsdp_backward_hint = check_fsdp_modules(modules, "set_modules_to_backward_prefetch")

    def set_post_optim_event(self, event: Any) -> None:
        """Let the next forward's first all-gather wait on ``event`` (recorded after the
        optimizer step) instead of on the whole current stream. A single-stream implementation
        has nothing to overlap and ignores it."""
        self._fsdp_post_optim_event = event

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """How many reduce-scatter input buffers may be in flight at once (>= 1): with K, the
        compute stream waits for a group's reduce-scatter only K groups later, for K packed
        buffers of memory. The optimized path keeps that many in flight; the reference, whose
        collectives block, accepts it and changes nothing."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise FSDPUsageError(
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise FSDPUsageError(f"max_input_buffers must be >= 1, got {max_input_buffers}")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True):
        """Run reduce-scatters on a process group of their own, so that they can progress
        beside all-gathers (one NCCL communicator serializes them). Accepted by an
        implementation without overlap, where it changes nothing."""
        _check_bool(enable, "set_separate_reduce_scatter_group")

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """torch's private switch for asynchronous unshards; accepted, with no effect."""
        _check_bool(async_op, "_set_unshard_async_op")
