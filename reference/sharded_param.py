"""One parameter under FSDP: its sharded, unsharded and in-between forms, and its gradient.

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

Backward leaves a whole gradient, (rows, *rest), on every rank; it waits (several backwards may
add up) until the group reduce-scatters it, and this rank's block joins the sharded gradient.

The contract. A parameter group moves a parameter between its states only through the public
methods below, in this order; the reference's ``ParamGroup`` calls them one parameter at a
time around blocking collectives, ``twinshard.optimized`` around its batched ones:

    unshard   all_gather_mesh -> all_gather_inputs -> all_gather_outputs -> (all-gather
              each input into its output) -> finish_unshard     (``ParamGroup.unshard_param``)
    reshard   reshard
    reduce    take_grad -> reduce_scatter_input -> (reduce-scatter) -> combine_partial_sum
              -> (all-reduce) -> accumulate_grad                (``ParamGroup.reduce_param``)
What differs between features (tensor parallel, ``Shard(dim)``, offload, the all-gather
extension, HSDP partial sums) is the parameter's ``Layout`` (``layout.py``): no branch here.
"""

from __future__ import annotations

from enum import Enum, auto

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from . import more
from .collectives import padded_rows
from .layout import Layout, pad_rows
from .mesh import MeshInfo, as_dtensor


class ParamState(Enum):
    SHARDED = auto()  # module holds the DTensor block; no unsharded memory
    SHARDED_POST_FORWARD = auto()  # a 1/N piece is kept for the backward all-gather
    UNSHARDED = auto()  # module holds the whole parameter as a plain tensor


class ShardedParam(more.GroupMethods):
    """Shards one parameter at construction and moves it between its states."""

    def __init__(
        self,
        param: nn.Parameter,
        owners: list[tuple[nn.Module, str]],
        info: MeshInfo,
        layout: Layout,
    ):
        self.owners = owners  # every (module, attribute) that holds it: tied weights share one
        self.fqn = owners[0][1]  # replaced by the full name at the root's first forward
        self.info = info  # its mesh: the group's, or its own (a ShardPlacementResult)
        self.layout = layout  # the plain one, or a feature's (second reading)
        self.device = layout.device  # where compute happens
        whole = layout.piece(param)  # what is cut: the parameter (or its tensor-parallel piece)
        self.shape = param.shape  # the global shape
        self.stride = torch.empty(param.shape, device="meta").stride()  # of the whole tensor
        rows_shape = layout.rows_first(torch.empty(whole.shape, device="meta")).shape
        self.rows = rows_shape[0]  # how many rows are cut into blocks
        self.chunk = padded_rows(self.rows, info.shard_size)  # rows in each rank's block
        self.block_shape = torch.Size((self.chunk, *rows_shape[1:]))  # one rank's padded block
        self.start = min(info.shard_rank * self.chunk, self.rows)  # this rank's first row
        self.local_rows = min(self.chunk, self.rows - self.start)  # its rows, padding not counted
        self.unsharded_param: nn.Parameter | None = None  # created at the first unshard
        self.all_gather_buffer: torch.Tensor | None = None  # (S * chunk, *rest); holds it
        self.post_forward_block: torch.Tensor | None = None  # SHARDED_POST_FORWARD piece
        self.grad_to_reduce: torch.Tensor | None = None  # (rows, *rest) unreduced gradient sum
        self.sharded_param = nn.Parameter(self._shard(whole), requires_grad=param.requires_grad)
        self.state = ParamState.SHARDED
        self._register(self.sharded_param)

    # --- construction and the module attribute ----------------------------------------------
    def _shard(self, param: torch.Tensor) -> DTensor:
        """Cut this rank's block of rows out of the full parameter and wrap it as a DTensor."""
        rows = self.layout.rows_first(param.detach())  # (rows, *rest)
        block = rows.narrow(0, self.start, self.local_rows)  # (local_rows, *rest)
        block = self.layout.rows_first(block)  # the parameter's own layout (its own inverse)
        device = param.device if param.device.type == "meta" else self.layout.shard_device
        # our own, contiguous memory, not a view of the full tensor
        block = block.to(device).clone(memory_format=torch.contiguous_format)
        mesh, placements, stride = self.layout.shard_spec(self.info, self.stride)
        block = self.layout.kept_shard(block)  # in the memory the layout keeps it in
        return as_dtensor(block, mesh, placements, shape=self.shape, stride=stride)

    def _register(self, tensor: nn.Parameter) -> None:
        # Writing _parameters directly skips nn.Module.__setattr__'s checks on every swap.
        for module, name in self.owners:
            module._parameters[name] = tensor

    @property
    def local_shard(self) -> torch.Tensor:
        """The sharded ``DTensor``'s local tensor itself (``to_local()`` makes a new view)."""
        return self.sharded_param._local_tensor

    def adopt_local(self, tensor: torch.Tensor) -> None:
        """Make ``tensor`` (local_rows, *rest), memory the caller owns, the sharded ``DTensor``'s
        local tensor: an optimizer holding the ``DTensor`` steps ``tensor`` from now on."""
        self.sharded_param._local_tensor = tensor

    @property
    def held(self) -> nn.Parameter:
        """What the module holds now: the sharded parameter, or what the user put there."""
        return self.owners[0][0]._parameters[self.owners[0][1]]

    def refresh(self) -> None:
        """Adopt the module's parameter if the user replaced it (``to_empty``, DCP, assigning
        loads), and the layout its shard asks for now (``more.layout_for_shard``)."""
        current = self.held
        self.layout = more.layout_for_shard(self, current)
        if current is not self.sharded_param:
            self.sharded_param = current
            self._register(current)
        self.layout.settle(self)

    # --- unshard and reshard ----------------------------------------------------------------
    def all_gather_mesh(self, post_forward: MeshInfo | None) -> MeshInfo:
        """Whose blocks make up the whole parameter: the N ranks of the post-forward mesh
        when only a 1/N piece was kept after forward, else the shard group."""
        return post_forward if self.state is ParamState.SHARDED_POST_FORWARD else self.info

    def all_gather_inputs(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """What this rank contributes to the all-gather, on the compute device: its block
        (chunk, *rest) in ``dtype``, the kept post-forward piece, or what the layout hands
        over instead (a shard that gathers itself: the all-gather extension)."""
        if self.post_forward_block is not None:
            return [self.post_forward_block]  # (S * chunk / N, *rest)
        self.refresh()  # the shard the module holds now decides
        return self.layout.gather_inputs(self, dtype)

    def all_gather_outputs(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """The tensors the all-gather fills, with their memory (re)allocated, one per tensor of
        ``all_gather_inputs`` (called right before): ``all_gather_output`` for a plain block."""
        return self.layout.gather_outputs(self, dtype)

    def all_gather_output(self, dtype: torch.dtype) -> torch.Tensor:
        """The tensor the all-gather fills, (S * chunk, *rest), with its memory (re)allocated:
        its first ``rows`` rows are the unsharded parameter, the rest padding."""
        if self.all_gather_buffer is None:
            shape = (self.info.shard_size * self.chunk, *self.block_shape[1:])  # (S * chunk, ...)
            self.all_gather_buffer = torch.empty(shape, dtype=dtype, device=self.device)
            # ``.data`` gives the parameter its own version counter, so that writing the
            # all-gather into the buffer does not look like an in-place change to autograd.
            view = self.all_gather_buffer.data.narrow(0, 0, self.rows)  # (rows, *rest)
            whole = self.layout.unsharded(self.layout.rows_first(view))  # the parameter's layout
            self.unsharded_param = nn.Parameter(
                whole, requires_grad=self.sharded_param.requires_grad
            )
            # its memory, and how many bytes of it, kept for the resizes of every later step
            self.all_gather_storage = self.all_gather_buffer.untyped_storage()
            self.all_gather_bytes = self.all_gather_storage.nbytes()
        else:
            self.all_gather_storage.resize_(self.all_gather_bytes)
        return self.all_gather_buffer

    def finish_unshard(self) -> None:
        """Once ``all_gather_outputs`` hold the gathered rows: put the unsharded parameter on
        the module and drop the post-forward piece."""
        self.post_forward_block = None
        made = self.layout.finish(self)  # the all-gather extension makes it at the first one
        if made is not None:
            self.unsharded_param = made
        self.unsharded_param.requires_grad_(self.sharded_param.requires_grad)
        self._register(self.unsharded_param)
        self.state = ParamState.UNSHARDED

    def reshard(self, post_forward: MeshInfo | None = None) -> None:
        """Free the unsharded memory and put the DTensor back on the module; with
        ``post_forward`` (an int ``reshard_after_forward``), keep this rank's 1/N piece."""
        if self.state is not ParamState.UNSHARDED:
            return
        keep_piece = post_forward is not None and post_forward is not self.info
        if keep_piece:
            self.post_forward_block = self.layout.piece_to_keep(self, post_forward)
        self.layout.free(self)  # the memory FSDP saves
        self._register(self.sharded_param)
        self.state = ParamState.SHARDED_POST_FORWARD if keep_piece else ParamState.SHARDED

    # --- the gradient: take it, reduce it, add it to the sharded one ------------------------
    @property
    def has_new_grad(self) -> bool:
        """Whether autograd wrote an unsharded ``.grad`` that ``take_grad`` has not taken."""
        return self.unsharded_param is not None and self.unsharded_param.grad is not None

    def take_grad(self, reduce_dtype: torch.dtype) -> None:
        """Move autograd's unsharded ``.grad`` into the sum waiting to be reduced: as it is (the
        reduction casts it), or added to a sum kept in ``reduce_dtype`` (cast first if narrower)."""
        grad = self.unsharded_param.grad if self.unsharded_param is not None else None
        if grad is None:
            return
        grad = self.layout.local_grad(grad, reduce_dtype)  # (rows, *rest), a plain tensor
        self.unsharded_param.grad = None
        if self.grad_to_reduce is not None:  # a gradient that widens into the sum: not copied
            wide = torch.promote_types(grad.dtype, reduce_dtype) == reduce_dtype
            grad = grad if wide else grad.to(reduce_dtype)
            grad = self.grad_to_reduce.to(reduce_dtype).add_(grad)
        self.grad_to_reduce = grad  # (rows, *rest)

    @property
    def has_grad_to_reduce(self) -> bool:
        """Whether a gradient from this rank's backward waits to be reduced."""
        return self.grad_to_reduce is not None

    def reduce_scatter_input(self, dtype: torch.dtype) -> torch.Tensor | None:
        """Hand over the waiting gradient, padded to (S * chunk, *rest), not cast (the caller casts
        to ``dtype``, the reduce dtype); zeros of ``dtype`` for a trainable parameter with none
        here (every rank sends the same amount, whichever it used); None for a frozen one."""
        rows = self.info.shard_size * self.chunk
        if self.grad_to_reduce is None:
            alone = self.info.shard_size * self.info.replicate_size == 1
            if not self.sharded_param.requires_grad or alone:
                return None  # frozen, or alone: nothing to keep in step with
            return torch.zeros((rows, *self.block_shape[1:]), dtype=dtype, device=self.device)
        grad = pad_rows(self.layout.rows_first(self.grad_to_reduce), rows)  # (S * chunk, *rest)
        self.grad_to_reduce = None
        return grad.contiguous()

    def combine_partial_sum(self, block: torch.Tensor, all_reduce: bool) -> torch.Tensor | None:
        """HSDP: the reduce-scattered ``block`` (chunk, *rest) plus what earlier backwards kept
        back, to all-reduce now; None when ``all_reduce`` is False (the HSDP layout's)."""
        return self.layout.combine_partial_sum(block, all_reduce)

    def accumulate_grad(self, block: torch.Tensor) -> None:
        """Add a reduced block (chunk, *rest) to the sharded ``DTensor`` gradient, dropping the
        padding rows and moving it to the shard's layout, dtype and memory."""
        if self.local_rows < self.chunk:  # (slicing costs a microsecond even when it keeps all)
            block = block[: self.local_rows]  # (local_rows, *rest)
        block = self.layout.grad_block(self, block)  # (local_rows, *rest) as the shard
        if self.sharded_param.grad is None:
            # Laid out like its parameter, it takes the parameter's spec as it is: ``from_local``
            # (a new spec, checked) and the class (its ``__init__`` is compiler-guarded) cost more.
            spec = self.sharded_param._spec  # mesh, placements, global shape, stride, dtype
            grad = DTensor.__new__(DTensor, block.contiguous(), spec, requires_grad=False)
            self.sharded_param.grad = grad
        else:
            self.sharded_param.grad.to_local().add_(block)
        # Autograd never accumulates into the sharded parameter, so its post-accumulate-grad
        # hooks run here, as torch's FSDP2 does (an optimizer stepped in backward needs them).
        for hook in (self.sharded_param._post_accumulate_grad_hooks or {}).values():
            hook(self.sharded_param)

    def discard_grads(self) -> None:
        """Drop every gradient not yet reduced (after an aborted iteration)."""
        self.grad_to_reduce = None
        self.layout.discard()
        if self.unsharded_param is not None:
            self.unsharded_param.grad = None
