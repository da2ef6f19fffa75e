"""Parameters that gather themselves: FSDP2's all-gather extension.

A parameter's local shard may define two methods, on its class (a tensor subclass such as a
float8 weight, which gathers its bytes and its scale) or on the tensor object itself, and so
decide what is all-gathered and how the unsharded parameter is made from it:

    inputs, metadata = shard.fsdp_pre_all_gather(mesh)   # or (mesh, outer_size, outer_stride,
                                                          #     module, mp_policy)
    outputs = every input all-gathered                   # (S * rows_i, *rest_i) each
    first unshard:  tensor, inner = shard.fsdp_post_all_gather(outputs, metadata, param_dtype)
    later ones:     shard.fsdp_post_all_gather(outputs, metadata, param_dtype, out=unsharded)

The methods are looked up at every unshard: they may be set on a shard after ``to_empty``,
before its first unshard. ``mesh`` is the shard group's 1D mesh, for HSDP too. Every rank
hands in inputs of the same shapes; where the rows do not divide over the ranks, each must
have the padded block's shape (chunk, *rest), as torch asks: the extension pads. Every rank
checks that (each knows the rows do not divide): an error everywhere, no collective that waits.

As for a plain parameter (``sharded_param.py``) the unsharded parameter is one object for the
whole run: the first call's ``tensor``, its padding rows cut off. Resharding frees the memory
of the outputs and of ``inner`` (the plain tensors the unsharded parameter is made of); the
next unshard allocates it again, the all-gather fills the same outputs, and the
post-all-gather writes into the same parameter. The outputs are handed over as ``.data``
views, so that the all-gather writing into them is no in-place change autograd would see.

Collectives move plain tensors: an input that is itself a subclass is copied into a plain
tensor first (what its ``copy_`` writes is what is sent). A subclass parameter without the
two methods cannot be gathered as one tensor and is refused at its first unshard, by name.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from twinshard.api import FSDPUsageError


class ExtensionPath:
    """``ShardedParam``'s all-gather methods that know the extension (see its contract)."""

    extended = False  # whether the unshard in progress goes through the extension
    extension_outputs: list | None = None  # per input, the tensor its all-gather fills
    extension_storages: list = []  # [(storage, bytes)]: freed at reshard, allocated at unshard

    def all_gather_inputs(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """What this rank contributes to the all-gather, on the compute device: the one block
        of ``all_gather_input`` (chunk, *rest), or the inputs of the shard's
        ``fsdp_pre_all_gather``. A post-forward piece is always a plain block."""
        self.extended = False
        if self.post_forward_block is None:
            self.refresh()  # the methods belong to the shard the module holds now
            shard = self.sharded_param._local_tensor
            if hasattr(shard, "fsdp_pre_all_gather"):
                return self.extension_inputs(shard, dtype)
            if is_traceable_wrapper_subclass(shard):
                raise FSDPUsageError(
                    f"parameter '{self.fqn}' of {type(self.owners[0][0]).__name__} is a "
                    f"{type(shard).__name__}, a tensor subclass without fsdp_pre_all_gather and "
                    "fsdp_post_all_gather: FSDP cannot gather it as one tensor. Define both "
                    "(FSDP2's all-gather extension) or pass it in ignored_params"
                )
        return [self.all_gather_input(dtype)]

    def extension_inputs(self, shard: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
        if self.tp is not None or self.dim:
            raise FSDPUsageError(
                f"parameter '{self.fqn}' defines fsdp_pre_all_gather, which twinshard supports "
                "for Shard(0) parameters without tensor parallelism; drop shard_placement_fn "
                "for it or keep it out of the tensor-parallel plan"
            )
        if self.unsharded_param is not None and self.extension_outputs is None:
            raise FSDPUsageError(
                f"parameter '{self.fqn}' got fsdp_pre_all_gather after its first all-gather; "
                "set the all-gather extension before the first forward or unshard (after "
                "to_empty and loading the weights is fine)"
            )
        pre = shard.fsdp_pre_all_gather
        if len(inspect.signature(pre).parameters) == 1:  # the first form: the mesh alone
            inputs, self.extension_metadata = pre(self.info.shard_mesh)
        else:
            module = self.owners[0][0]
            inputs, self.extension_metadata = pre(
                self.info.shard_mesh, self.shape, self.stride, module, self.mp
            )
        self.extended, self.extension_dtype = True, dtype
        uneven = self.rows % self.info.shard_size != 0
        if uneven and any(x.shape != self.block_shape for x in inputs):
            raise FSDPUsageError(
                f"parameter '{self.fqn}' of shape {tuple(self.shape)} does not divide over "
                f"{self.info.shard_size} ranks, so fsdp_pre_all_gather must return inputs "
                f"padded to {tuple(self.block_shape)}; it returned "
                f"{[tuple(x.shape) for x in inputs]}"
            )
        plain = []
        for x in inputs:  # (rows_i, *rest_i) each, the same shapes on every rank
            if is_traceable_wrapper_subclass(x):
                x = torch.empty(x.shape, dtype=x.dtype, device=self.device).copy_(x)
            plain.append(x.to(self.device).contiguous())
        self.extension_shapes = [(x.shape, x.dtype) for x in plain]
        return plain

    def all_gather_outputs(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """The tensors the all-gather fills, one per tensor of ``all_gather_inputs`` (called
        right before), with their memory (re)allocated: (S * chunk, *rest) for a plain block
        (``all_gather_output``), (S * rows_i, *rest_i) for each input of the extension."""
        if not self.extended:
            return [self.all_gather_output(dtype)]
        if self.extension_outputs is None:
            self.extension_outputs = [
                torch.empty((self.info.shard_size * shape[0], *shape[1:]), dtype=kind,
                            device=self.device)
                for shape, kind in self.extension_shapes
            ]  # fmt: skip
        for storage, nbytes in self.extension_storages:
            storage.resize_(nbytes)
        return self.extension_outputs

    def finish_extension(self) -> None:
        """Make the unsharded parameter from the gathered outputs (``finish_unshard``)."""
        outputs = tuple(o.data for o in self.extension_outputs)  # see the module docstring
        post = self.sharded_param._local_tensor.fsdp_post_all_gather
        if self.unsharded_param is not None:
            post(outputs, self.extension_metadata, self.extension_dtype, out=self.unsharded_param)
            return
        tensor, inner = post(outputs, self.extension_metadata, self.extension_dtype)
        whole = torch.as_strided(tensor, self.shape, self.stride, 0)  # padding rows cut off
        self.unsharded_param = nn.Parameter(whole, requires_grad=self.sharded_param.requires_grad)
        storages = {}  # each memory once: the outputs and ``inner`` may share it
        for t in (*self.extension_outputs, *inner):
            storages.setdefault(t.untyped_storage()._cdata, t.untyped_storage())
        self.extension_storages = [(s, s.nbytes()) for s in storages.values()]

    def free_extension(self, keep_piece: bool) -> None:
        """Free what the extension's unshard allocated (``reshard``)."""
        if keep_piece:
            raise FSDPUsageError(
                f"parameter '{self.fqn}' defines fsdp_pre_all_gather, whose all-gather cannot "
                "run over fewer ranks in backward; use reshard_after_forward=True or False"
            )
        for storage, _ in self.extension_storages:
            storage.resize_(0)
