"""One parameter under FSDP: its sharded, unsharded and in-between forms.

A parameter of shape (rows, *rest) lives in one of three states:

- SHARDED: the module holds a ``DTensor`` whose local tensor is this rank's block of rows
  (``Shard(0)``: rank r keeps rows [r * chunk, (r + 1) * chunk), fewer or none at the end when
  rows do not divide). This is what the optimizer steps and what ``state_dict()`` returns.
- UNSHARDED: the module holds the whole parameter as a plain tensor, all-gathered from the
  blocks, in the compute dtype. Forward and backward use it; autograd writes its ``.grad``.
- SHARDED_POST_FORWARD: between forward and backward with ``reshard_after_forward=N``, this
  rank keeps a 1/N piece of the whole parameter, to all-gather among N ranks in backward.

The key trick of FSDP lives here. Autograd saves the unsharded parameter in forward to use it
in backward, but we free the parameter's memory right after forward. So the unsharded
parameter is one tensor object for the whole training run: resharding shrinks its storage to
zero bytes, unsharding grows it back and all-gathers into it. What autograd saved is the same
object, so by the time backward needs it the data is there again.

The contract. A parameter group moves a parameter between its states only through the public
methods below, in this order; the reference's ``ParamGroup`` calls them one parameter at a
time, and ``twinshard.optimized`` calls the very same methods around its batched collectives:

    unshard   all_gather_mesh -> all_gather_input -> (all-gather) -> all_gather_output
              -> finish_unshard                                   (``unshard`` does all five)
    reshard   reshard
    reduce    take_grad -> reduce_scatter_input -> (reduce-scatter) -> combine_partial_sum
              -> (all-reduce) -> accumulate_grad                  (``reduce_grad`` does them all)
"""

from __future__ import annotations

from enum import Enum, auto

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from twinshard.api import CommHooks, CPUOffloadPolicy, FSDPUsageError
from twinshard.guard import check_collective

from .collectives import all_gather_rows, all_reduce_sum, pad_rows, padded_rows, reduce_scatter_rows
from .mesh import MeshInfo


class ParamState(Enum):
    SHARDED = auto()  # module holds the DTensor block; no unsharded memory
    SHARDED_POST_FORWARD = auto()  # a 1/N piece is kept for the backward all-gather
    UNSHARDED = auto()  # module holds the whole parameter as a plain tensor


class ShardedParam:
    """Shards one parameter at construction and moves it between its states."""

    def __init__(
        self,
        param: nn.Parameter,
        owners: list[tuple[nn.Module, str]],
        info: MeshInfo,
        device: torch.device,
        offload: CPUOffloadPolicy | None,
    ):
        if param.dim() == 0:
            raise FSDPUsageError(
                f"fully_shard cannot shard the 0-dim parameter '{owners[0][1]}' of "
                f"{type(owners[0][0]).__name__}; reshape it to (1,) or pass it in ignored_params"
            )
        self.owners = owners  # every (module, attribute) that holds it: tied weights share one
        self.fqn = owners[0][1]  # replaced by the full name at the root's first forward
        self.info = info
        self.device = device  # where compute happens
        self.shard_device = torch.device("cpu") if offload is not None else device
        # Pinned host memory lets the copy to an accelerator run without staging.
        self.pin = offload is not None and offload.pin_memory and device.type != "cpu"
        self.shape = param.shape  # (rows, *rest), the global shape
        self.stride = torch.empty(param.shape, device="meta").stride()  # of the whole tensor
        self.chunk = padded_rows(param.shape[0], info.shard_size)  # rows in each rank's block
        self.block_shape = torch.Size((self.chunk, *param.shape[1:]))  # one rank's padded block
        self.unsharded_param: nn.Parameter | None = None  # created at the first unshard
        self.all_gather_buffer: torch.Tensor | None = None  # (S * chunk, *rest); holds it
        self.post_forward_block: torch.Tensor | None = None  # SHARDED_POST_FORWARD piece
        self.grad_to_reduce: torch.Tensor | None = None  # (rows, *rest) unreduced gradient sum
        self.partial_sum: torch.Tensor | None = None  # HSDP: reduce-scattered, not all-reduced
        self.sharded_param = nn.Parameter(self._shard(param), requires_grad=param.requires_grad)
        self.state = ParamState.SHARDED
        self._register(self.sharded_param)

    # --- construction and the module attribute ----------------------------------------------
    def _shard(self, param: torch.Tensor) -> DTensor:
        """Cut this rank's block of rows out of the full parameter and wrap it as a DTensor."""
        start = min(self.info.shard_rank * self.chunk, self.shape[0])
        length = min(self.chunk, self.shape[0] - start)
        block = param.detach().narrow(0, start, length)  # (length <= chunk, *rest)
        device = param.device if param.device.type == "meta" else self.shard_device
        block = block.to(device).clone()  # our own memory, not a view of the full tensor
        if self.pin and device.type == "cpu":
            block = block.pin_memory()
        return self._as_dtensor(block)

    def _as_dtensor(self, block: torch.Tensor) -> DTensor:
        return DTensor.from_local(
            block,
            self.info.mesh,
            self.info.placements,
            run_check=False,
            shape=self.shape,
            stride=self.stride,
        )

    def _register(self, tensor: nn.Parameter) -> None:
        # Writing _parameters directly skips nn.Module.__setattr__'s checks on every swap.
        for module, name in self.owners:
            module._parameters[name] = tensor

    def refresh(self) -> None:
        """Adopt the module's sharded parameter if the user replaced it.

        ``model.to_empty(...)``, ``load_state_dict(assign=True)`` and DCP may put a new
        ``DTensor`` parameter on the module; from then on that one is the sharded parameter.
        """
        current = self.owners[0][0]._parameters[self.owners[0][1]]
        if current is not self.sharded_param:
            if not isinstance(current, DTensor) or current.shape != self.shape:
                raise FSDPUsageError(
                    f"parameter '{self.fqn}' was replaced by a {type(current).__name__} of shape "
                    f"{tuple(current.shape)} outside fully_shard; load values with "
                    "load_state_dict or copy_ into the existing DTensor instead"
                )
            self.sharded_param = current
            self._register(current)
        if self.sharded_param.device.type == "meta":
            raise FSDPUsageError(
                f"parameter '{self.fqn}' is still on the meta device; materialize it first, "
                "e.g. model.to_empty(device=...) and then initialize or load the weights"
            )

    # --- unshard and reshard ----------------------------------------------------------------
    def unshard(self, dtype: torch.dtype, post_forward: MeshInfo | None, comm=None) -> None:
        """All-gather the whole parameter into the unsharded tensor and put it on the module
        (with ``comm``, the user's all-gather, if one was set)."""
        if self.state is ParamState.UNSHARDED:
            return
        group = self.all_gather_mesh(post_forward).shard_group
        block = self.all_gather_input(dtype)  # (chunk, *rest), or (S*chunk/N, *rest)
        check_collective("all_gather", block, group, self.fqn)  # debug mode: do the ranks agree?
        all_gather_rows(self.all_gather_output(dtype), block, group, comm)  # (S * chunk, *rest)
        self.finish_unshard()

    def all_gather_mesh(self, post_forward: MeshInfo | None) -> MeshInfo:
        """Whose blocks make up the whole parameter: the N ranks of the post-forward mesh
        when only a 1/N piece was kept after forward, else the shard group."""
        return post_forward if self.state is ParamState.SHARDED_POST_FORWARD else self.info

    def all_gather_input(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's part of the all-gather, on the compute device, in ``dtype``: the kept
        post-forward piece, or the sharded block padded to ``chunk`` rows."""
        if self.state is ParamState.SHARDED_POST_FORWARD:
            return self.post_forward_block  # (S * chunk / N, *rest)
        self.refresh()
        local = self.sharded_param.to_local()  # (<= chunk, *rest)
        return pad_rows(local.to(self.device, dtype), self.chunk)  # (chunk, *rest)

    def all_gather_output(self, dtype: torch.dtype) -> torch.Tensor:
        """The tensor the all-gather fills, (S * chunk, *rest), with its memory (re)allocated.

        Its first ``rows`` rows are the unsharded parameter; the rest are padding."""
        rows = self.info.shard_size * self.chunk
        if self.all_gather_buffer is None:
            self.all_gather_buffer = torch.empty(
                (rows, *self.shape[1:]), dtype=dtype, device=self.device
            )
            # ``.data`` gives the parameter its own version counter, so that writing the
            # all-gather into the buffer does not look like an in-place change to autograd.
            view = self.all_gather_buffer.data.narrow(0, 0, self.shape[0])  # (rows, *rest)
            self.unsharded_param = nn.Parameter(
                view, requires_grad=self.sharded_param.requires_grad
            )
        else:
            buffer = self.all_gather_buffer
            buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
        return self.all_gather_buffer

    def finish_unshard(self) -> None:
        """Once ``all_gather_output`` holds the gathered rows: put the unsharded parameter on
        the module and drop the post-forward piece."""
        self.post_forward_block = None
        self.unsharded_param.requires_grad_(self.sharded_param.requires_grad)
        self._register(self.unsharded_param)
        self.state = ParamState.UNSHARDED

    def reshard(self, post_forward: MeshInfo | None = None) -> None:
        """Free the unsharded memory and put the DTensor back on the module.

        With ``post_forward`` (an int ``reshard_after_forward``), keep this rank's 1/N piece.
        """
        if self.state is not ParamState.UNSHARDED:
            return
        buffer = self.all_gather_buffer  # (S * chunk, *rest)
        if post_forward is not None and post_forward is not self.info:
            piece = buffer.shape[0] // post_forward.shard_size
            start = post_forward.shard_rank * piece
            self.post_forward_block = buffer[start : start + piece].clone()  # (S*chunk/N, *rest)
        buffer.untyped_storage().resize_(0)  # the memory FSDP saves
        self._register(self.sharded_param)
        keep_piece = self.post_forward_block is not None
        self.state = ParamState.SHARDED_POST_FORWARD if keep_piece else ParamState.SHARDED

    # --- gradients --------------------------------------------------------------------------
    @property
    def has_new_grad(self) -> bool:
        """Whether autograd wrote an unsharded ``.grad`` that ``take_grad`` has not taken."""
        return self.unsharded_param is not None and self.unsharded_param.grad is not None

    def take_grad(self, reduce_dtype: torch.dtype) -> None:
        """Move autograd's unsharded ``.grad`` into the sum waiting to be reduced."""
        if not self.has_new_grad:
            return
        grad = self.unsharded_param.grad.to(reduce_dtype)  # (rows, *rest)
        self.unsharded_param.grad = None
        if self.grad_to_reduce is None:
            self.grad_to_reduce = grad
        else:
            self.grad_to_reduce += grad

    def reduce_grad(
        self, dtype: torch.dtype, divide_by: float, all_reduce: bool, comms: CommHooks, keep_unused
    ) -> bool | None:
        """Reduce-scatter the waiting gradient (and all-reduce it across HSDP replicas), then
        add this rank's block to the sharded ``DTensor`` gradient. Returns whether this rank had
        a gradient (None for a frozen parameter, which takes no part)."""
        used = self.has_grad_to_reduce
        grad = self.reduce_scatter_input(dtype)  # (S * chunk, *rest), zeros if unused here
        if grad is None:
            return None
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
            self.accumulate_grad(block / divide_by)  # the sum over ranks becomes their mean
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
            return torch.zeros((rows, *self.shape[1:]), dtype=dtype, device=self.device)
        grad = pad_rows(self.grad_to_reduce, rows)  # (S * chunk, *rest)
        self.grad_to_reduce = None
        return grad

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
        local_rows = self.sharded_param.to_local().shape[0]
        block = block[:local_rows].to(self.sharded_param.dtype).to(self.shard_device)
        if self.sharded_param.grad is None:
            self.sharded_param.grad = self._as_dtensor(block.contiguous())  # (<= chunk, *rest)
        else:
            self.sharded_param.grad.to_local().add_(block)
        # Autograd never accumulates into the sharded parameter, so it never runs the hooks
        # registered with register_post_accumulate_grad_hook: run them here, as torch's FSDP2
        # does (an optimizer stepped inside backward relies on them).
        for hook in (self.sharded_param._post_accumulate_grad_hooks or {}).values():
            hook(self.sharded_param)

    def discard_grads(self) -> None:
        """Drop every gradient not yet reduced (after an aborted iteration)."""
        self.grad_to_reduce = self.partial_sum = None
        if self.unsharded_param is not None:
            self.unsharded_param.grad = None
