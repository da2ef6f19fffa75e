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

    unshard   all_gather_mesh -> all_gather_inputs -> all_gather_outputs -> (all-gather
              each input into its output) -> finish_unshard       (``unshard`` does all five)
    reshard   reshard
    keep      shard_storage_shape -> keep_shard_in; shard_is_kept at each unshard
              (an implementation's own storage for the shards; the reference does not use it)
    reduce    take_grad -> reduce_scatter_input -> (reduce-scatter) -> combine_partial_sum
              -> (all-reduce) -> accumulate_grad                  (``reduce_grad`` does them all)
"""

from __future__ import annotations

from enum import Enum, auto

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from twinshard.api import CPUOffloadPolicy, FSDPUsageError
from twinshard.guard import check_collective

from .collectives import all_gather_rows, pad_rows, padded_rows
from .extension import ExtensionPath
from .mesh import MeshInfo
from .sharded_grad import GradientPath
from .tensor_parallel import tp_layout


class ParamState(Enum):
    SHARDED = auto()  # module holds the DTensor block; no unsharded memory
    SHARDED_POST_FORWARD = auto()  # a 1/N piece is kept for the backward all-gather
    UNSHARDED = auto()  # module holds the whole parameter as a plain tensor


class ShardedParam(GradientPath, ExtensionPath):
    """Shards one parameter at construction and moves it between its states."""

    def __init__(
        self,
        param: nn.Parameter,
        owners: list[tuple[nn.Module, str]],
        info: MeshInfo,
        device: torch.device,
        offload: CPUOffloadPolicy | None,
        dim: int = 0,
        mp=None,  # the group's MixedPrecisionPolicy, for an all-gather extension
    ):
        if param.dim() == 0:
            raise FSDPUsageError(
                f"fully_shard cannot shard the 0-dim parameter of {type(owners[0][0]).__name__}. "
                f"Change {owners[0][1]} to a 1D tensor with numel equal to 1 or ignore it"
            )
        self.owners = owners  # every (module, attribute) that holds it: tied weights share one
        self.fqn = owners[0][1]  # replaced by the full name at the root's first forward
        self.info = info
        self.device = device  # where compute happens
        self.shard_device = torch.device("cpu") if offload is not None else device
        # Pinned host memory lets the copy to an accelerator run without staging.
        self.pin = offload is not None and offload.pin_memory and device.type != "cpu"
        self.tp = tp_layout(param, info, self.fqn)  # tensor parallel: shard each rank's piece
        whole = param.to_local() if self.tp is not None else param  # what FSDP cuts and gathers
        self.mp = mp
        self.shape = param.shape  # the global shape
        self.stride = torch.empty(param.shape, device="meta").stride()  # of the whole tensor
        self.dim = dim % param.dim()  # the dim cut into blocks ("rows"; 0 unless Shard(dim))
        self.rows = whole.shape[self.dim]  # how many rows are cut into blocks
        rows_shape = self.rows_first(torch.empty(whole.shape, device="meta")).shape
        self.chunk = padded_rows(rows_shape[0], info.shard_size)  # rows in each rank's block
        self.block_shape = torch.Size((self.chunk, *rows_shape[1:]))  # one rank's padded block
        self.start = min(info.shard_rank * self.chunk, self.rows)  # this rank's first row
        self.local_rows = min(self.chunk, self.rows - self.start)  # its rows, padding not counted
        self.unsharded_param: nn.Parameter | None = None  # created at the first unshard
        self.all_gather_buffer: torch.Tensor | None = None  # (S * chunk, *rest); holds it
        self.post_forward_block: torch.Tensor | None = None  # SHARDED_POST_FORWARD piece
        self.grad_to_reduce: torch.Tensor | None = None  # (rows, *rest) unreduced gradient sum
        self.partial_sum: torch.Tensor | None = None  # HSDP: reduce-scattered, not all-reduced
        self.kept_local: torch.Tensor | None = None  # keep_shard_in: the view it made the local
        self.sharded_param = nn.Parameter(self._shard(whole), requires_grad=param.requires_grad)
        self.state = ParamState.SHARDED
        self._register(self.sharded_param)

    # --- construction and the module attribute ----------------------------------------------
    def rows_first(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` viewed with the sharded dim first: (rows, *rest). Every block, all-gather and
        reduce-scatter works on this view; for ``Shard(0)`` it is ``t`` itself. (Swapping two
        dims is its own inverse, so this also turns a rows-first tensor back.)"""
        return t.transpose(0, self.dim) if self.dim else t

    def _shard(self, param: torch.Tensor) -> DTensor:
        """Cut this rank's block of rows out of the full parameter and wrap it as a DTensor."""
        rows = self.rows_first(param.detach())  # (rows, *rest)
        block = rows.narrow(0, self.start, self.local_rows)  # (local_rows, *rest)
        block = self.rows_first(block)  # the parameter's own layout
        device = param.device if param.device.type == "meta" else self.shard_device
        # our own, contiguous memory, not a view of the full tensor
        block = block.to(device).clone(memory_format=torch.contiguous_format)
        if self.pin and device.type == "cpu":
            block = block.pin_memory()
        return self._as_dtensor(block)

    def _as_dtensor(self, block: torch.Tensor) -> DTensor:
        mesh, stride = self.info.mesh, self.stride
        placements = tuple(
            Shard(self.dim) if isinstance(q, Shard) else q for q in self.info.placements
        )
        if self.tp is not None:  # a 2-D (dp, tp) DTensor; see tensor_parallel.py
            mesh, stride = self.tp.spmd_mesh, self.tp.stride
            placements = self.tp.sharded_placements(self.info, self.dim)
        # The spec comes from a meta stand-in: ``from_local`` would move a host block (offload)
        # onto the mesh's device; as torch's, a sharded parameter stays where its block lies.
        spec = DTensor.from_local(
            block.to("meta"), mesh, placements, run_check=False, shape=self.shape, stride=stride
        )._spec
        return DTensor.__new__(DTensor, block, spec, requires_grad=False)

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
        if self.sharded_param.is_meta:
            raise FSDPUsageError(
                f"parameter '{self.fqn}' is still on the meta device; materialize it first, "
                "e.g. model.to_empty(device=...) and then initialize or load the weights"
            )
        local = self.sharded_param._local_tensor
        if local.device != self.shard_device:  # offloaded, then moved with the module (to_empty)
            local = local.to(self.shard_device)
            self.sharded_param._local_tensor = local.pin_memory() if self.pin else local

    def on_meta(self) -> bool:
        """Whether the module's parameter (this one, or one that replaced it) is on meta."""
        module, name = self.owners[0]
        return module._parameters[name].is_meta

    # --- unshard and reshard ----------------------------------------------------------------
    def unshard(self, dtype: torch.dtype, post_forward: MeshInfo | None, comm=None) -> None:
        """All-gather the whole parameter into the unsharded tensor and put it on the module
        (with ``comm``, the user's all-gather, if one was set)."""
        if self.state is ParamState.UNSHARDED:
            return
        group = self.all_gather_mesh(post_forward).shard_group
        blocks = self.all_gather_inputs(dtype)  # [(chunk, *rest)], or an extension's inputs
        for block, out in zip(blocks, self.all_gather_outputs(dtype)):  # out: (S * chunk, *rest)
            check_collective("all_gather", block, group, self.fqn)  # debug mode: ranks agree?
            all_gather_rows(out, block, group, comm)
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
        # The DTensor's own local tensor: ``to_local()`` would return the same data, but for a
        # parameter it makes a new view at every call (torch 2.13), twice per step and parameter.
        local = self.rows_first(self.sharded_param._local_tensor)  # (<= chunk, *rest)
        local = local.to(self.device, dtype, non_blocking=self.pin)  # pinned: the host goes on
        return pad_rows(local, self.chunk).contiguous()  # (chunk, *rest)

    # --- the shard in storage the caller owns (a tensor per block, kept by the group) ----------
    def shard_storage_shape(self) -> torch.Size | None:
        """The (chunk, *rest) tensor ``keep_shard_in`` takes, or None where the shard cannot
        live in a caller's storage: a tensor-parallel parameter, a ``Shard(dim)`` with dim > 0
        (its block is not whole rows of memory), an offloaded one (its shard stays on the
        host while the all-gather runs on the compute device) and a tensor subclass or a shard
        with the all-gather extension (``extension.py``), asked at each call."""
        local = self.sharded_param._local_tensor
        if self.tp is not None or self.dim != 0 or self.shard_device != self.device:
            return None
        if hasattr(local, "__tensor_flatten__") or hasattr(local, "fsdp_pre_all_gather"):
            return None
        return self.block_shape

    def keep_shard_in(self, storage: torch.Tensor) -> None:
        """Move this rank's block into ``storage`` (chunk, *rest), a tensor the caller owns, in
        the sharded parameter's dtype: the block fills its first ``local_rows`` rows,
        the padding rows are zeroed, and the sharded ``DTensor`` takes that view as its local
        tensor. The ``DTensor`` stays the same object, so an optimizer holding it steps the
        storage from now on. The reference keeps each block on its own and does not call this;
        ``twinshard.optimized`` keeps a group's blocks padded, ready to be concatenated."""
        self.refresh()  # a replaced parameter is adopted first; a meta one is refused
        kept = storage.narrow(0, 0, self.local_rows)  # (local_rows, *rest)
        kept.copy_(self.sharded_param._local_tensor)
        storage.narrow(0, self.local_rows, self.chunk - self.local_rows).zero_()  # the padding
        self.sharded_param._local_tensor = kept
        self.kept_local, self.extended = kept, False  # a kept block is a plain one

    def shard_is_kept(self) -> bool:
        """Whether the module's sharded parameter still lives where ``keep_shard_in`` put it.
        ``load_state_dict(assign=True)``, ``to_empty`` or ``module.to`` give it new memory;
        loading values in place (``load_state_dict``, DCP, ``copy_``) keeps it there."""
        module, name = self.owners[0]
        return (
            module._parameters[name] is self.sharded_param
            and self.sharded_param._local_tensor is self.kept_local
            and not hasattr(self.kept_local, "fsdp_pre_all_gather")  # set on it since
        )

    def all_gather_output(self, dtype: torch.dtype) -> torch.Tensor:
        """The tensor the all-gather fills, (S * chunk, *rest), with its memory (re)allocated.

        Its first ``rows`` rows are the unsharded parameter; the rest are padding."""
        if self.all_gather_buffer is None:
            shape = (self.info.shard_size * self.chunk, *self.block_shape[1:])  # (S * chunk, ...)
            self.all_gather_buffer = torch.empty(shape, dtype=dtype, device=self.device)
            # ``.data`` gives the parameter its own version counter, so that writing the
            # all-gather into the buffer does not look like an in-place change to autograd.
            view = self.all_gather_buffer.data.narrow(0, 0, self.rows)  # (rows, *rest)
            whole = self.rows_first(view)  # in the parameter's own layout
            if self.dim:  # a transposed view: as torch's, the parameter gets contiguous memory
                self.own = torch.empty_like(whole, memory_format=torch.contiguous_format)
                self.gathered, whole = whole, self.own.data  # copied at each unshard; ``.data``
                self.own_bytes = whole.untyped_storage().nbytes()  # as above
            self.unsharded_param = nn.Parameter(
                self.tp.unsharded(whole) if self.tp is not None else whole,
                requires_grad=self.sharded_param.requires_grad,
            )
            # its memory, and how many bytes of it, kept for the resizes of every later step
            self.all_gather_storage = self.all_gather_buffer.untyped_storage()
            self.all_gather_bytes = self.all_gather_storage.nbytes()
        else:
            self.all_gather_storage.resize_(self.all_gather_bytes)
        return self.all_gather_buffer

    def finish_unshard(self) -> None:
        """Once ``all_gather_output`` holds the gathered rows: put the unsharded parameter on
        the module and drop the post-forward piece."""
        self.post_forward_block = None
        if self.extended:  # the extension makes the parameter from what it gathered
            self.finish_extension()
        if self.dim:  # filled from the gathered rows, as torch's Shard(dim) parameters are
            self.own.untyped_storage().resize_(self.own_bytes)
            self.own.copy_(self.gathered)  # (rows along dim, ...) in the parameter's layout
        self.unsharded_param.requires_grad_(self.sharded_param.requires_grad)
        self._register(self.unsharded_param)
        self.state = ParamState.UNSHARDED

    def reshard(self, post_forward: MeshInfo | None = None) -> None:
        """Free the unsharded memory and put the DTensor back on the module; with
        ``post_forward`` (an int ``reshard_after_forward``), keep this rank's 1/N piece."""
        if self.state is not ParamState.UNSHARDED:
            return
        buffer = self.all_gather_buffer  # (S * chunk, *rest)
        if self.extended:  # (extension.py: it refuses to keep a post-forward piece)
            self.free_extension(post_forward is not None and post_forward is not self.info)
        else:
            if post_forward is not None and post_forward is not self.info:
                piece = buffer.shape[0] // post_forward.shard_size
                start = post_forward.shard_rank * piece
                self.post_forward_block = buffer[start : start + piece].clone()  # (S*chunk/N, ...)
            self.all_gather_storage.resize_(0)  # the memory FSDP saves
        if self.dim:
            self.own.untyped_storage().resize_(0)
        self._register(self.sharded_param)
        keep_piece = self.post_forward_block is not None
        self.state = ParamState.SHARDED_POST_FORWARD if keep_piece else ParamState.SHARDED
