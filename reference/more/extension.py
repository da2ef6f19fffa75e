"""Second reading. Parameters that gather themselves: FSDP2's all-gather extension.

A parameter's local shard may define two methods, on its class (a tensor subclass such as a
float8 weight, which gathers its bytes and its scale) or on the tensor object itself, and so
decide what is all-gathered and how the unsharded parameter is made from it:

    inputs, metadata = shard.fsdp_pre_all_gather(mesh)   # or (mesh, outer_size, outer_stride,
                                                          #     module, mp_policy)
    outputs = every input all-gathered                   # (S * rows_i, *rest_i) each
    first unshard:  tensor, inner = shard.fsdp_post_all_gather(outputs, metadata, param_dtype)
    later ones:     shard.fsdp_post_all_gather(outputs, metadata, param_dtype, out=unsharded)

``mesh`` is the shard group's 1D mesh, for HSDP too. Every rank hands in inputs of the same
shapes; where the rows do not divide over the ranks, each must have the padded block's shape
(chunk, *rest), as torch asks, and every rank checks it: an error everywhere, no hang.

The ``Extension`` layout is added when an unshard first finds the methods (they may be set
after ``to_empty``; ``layouts.layout_for_shard``). As for a plain parameter, the unsharded
parameter is one object for the whole run, the first call's ``tensor`` without padding rows;
resharding frees the memory of the outputs and of ``inner``, the next unshard allocates it
again and the post-all-gather writes into the same parameter. Outputs are handed over as
``.data`` views, so that the all-gather's writes are no in-place change autograd would see.
Collectives move plain tensors: an input or a gradient that is a subclass is copied into a
plain tensor first. A subclass shard without the two methods is refused by name.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from twinshard.api import FSDPUsageError

from ..layout import Layout
from .tensor_parallel import ShardDim, TensorParallel


def gathers_itself(p, shard: torch.Tensor) -> bool:
    """Whether ``shard``, the local tensor of ``p``'s parameter, defines
    ``fsdp_pre_all_gather``; a tensor subclass that does not is refused by name."""
    if hasattr(shard, "fsdp_pre_all_gather"):
        return True
    if is_traceable_wrapper_subclass(shard):
        raise FSDPUsageError(
            f"parameter '{p.fqn}' of {type(p.owners[0][0]).__name__} is a "
            f"{type(shard).__name__}, a tensor subclass without fsdp_pre_all_gather and "
            "fsdp_post_all_gather: FSDP cannot gather it as one tensor. Define both "
            "(FSDP2's all-gather extension) or pass it in ignored_params"
        )
    return False


class Extension(Layout):
    """The layout of a shard that gathers itself: what its all-gather fills and the memory the
    unsharded parameter is made of, kept from one unshard to the next."""

    plain = False

    def setup(self, **_) -> None:
        self.outputs: list | None = None  # per input, the tensor its all-gather fills
        self.storages: list = []  # [(storage, bytes)]: freed at reshard, allocated at unshard

    def gather_inputs(self, p, dtype: torch.dtype) -> list[torch.Tensor]:
        """The inputs of the shard's ``fsdp_pre_all_gather``, plain and on the compute device
        (``ShardedParam.all_gather_inputs``)."""
        if isinstance(self, (TensorParallel, ShardDim)):
            raise FSDPUsageError(
                f"parameter '{p.fqn}' defines fsdp_pre_all_gather, which twinshard supports "
                "for Shard(0) parameters without tensor parallelism; drop shard_placement_fn "
                "for it or keep it out of the tensor-parallel plan"
            )
        if p.unsharded_param is not None and self.outputs is None:
            raise FSDPUsageError(
                f"parameter '{p.fqn}' got fsdp_pre_all_gather after its first all-gather; "
                "set the all-gather extension before the first forward or unshard (after "
                "to_empty and loading the weights is fine)"
            )
        pre = p.local_shard.fsdp_pre_all_gather
        mesh = p.info.mesh  # the shard group's 1D mesh, for HSDP too
        mesh = mesh if p.info.replicate_group is None else mesh[mesh.mesh_dim_names[1]]
        if len(inspect.signature(pre).parameters) == 1:  # the first form: the mesh alone
            inputs, self.metadata = pre(mesh)
        else:
            inputs, self.metadata = pre(mesh, p.shape, p.stride, p.owners[0][0], self.mp)
        self.dtype = dtype
        uneven = p.rows % p.info.shard_size != 0
        if uneven and any(x.shape != p.block_shape for x in inputs):
            raise FSDPUsageError(
                f"parameter '{p.fqn}' of shape {tuple(p.shape)} does not divide over "
                f"{p.info.shard_size} ranks, so fsdp_pre_all_gather must return inputs "
                f"padded to {tuple(p.block_shape)}; it returned "
                f"{[tuple(x.shape) for x in inputs]}"
            )
        plain = []
        for x in inputs:  # (rows_i, *rest_i) each, the same shapes on every rank
            if is_traceable_wrapper_subclass(x):  # (rows_i, *rest_i) as a plain tensor
                x = torch.empty(x.shape, dtype=x.dtype, device=p.device).copy_(x)  # (*x.shape)
            plain.append(x.to(p.device).contiguous())
        self.shapes = [(x.shape, x.dtype) for x in plain]
        return plain

    def gather_outputs(self, p, dtype: torch.dtype) -> list[torch.Tensor]:
        """What the all-gather fills, (S * rows_i, *rest_i) per input, memory (re)allocated."""
        if self.outputs is None:
            self.outputs = [
                torch.empty((p.info.shard_size * shape[0], *shape[1:]), dtype=kind,
                            device=p.device)
                for shape, kind in self.shapes  # (S * rows_i, *rest_i) each
            ]  # fmt: skip
        for storage, nbytes in self.storages:
            storage.resize_(nbytes)
        return self.outputs

    def finish(self, p) -> nn.Parameter | None:
        """Make the unsharded parameter from the gathered outputs (``finish_unshard``): a new
        one at the first unshard, the same one (written by the shard) at every later one."""
        outputs = tuple(o.data for o in self.outputs)  # see the module docstring
        post = p.local_shard.fsdp_post_all_gather
        if p.unsharded_param is not None:
            post(outputs, self.metadata, self.dtype, out=p.unsharded_param)
            return None
        tensor, inner = post(outputs, self.metadata, self.dtype)
        whole = torch.as_strided(tensor, p.shape, p.stride, 0)  # (rows, *rest): no padding
        storages = {}  # each memory once: the outputs and ``inner`` may share it
        for t in (*self.outputs, *inner):
            storages.setdefault(t.untyped_storage()._cdata, t.untyped_storage())
        self.storages = [(s, s.nbytes()) for s in storages.values()]
        return nn.Parameter(whole, requires_grad=p.sharded_param.requires_grad)

    def piece_to_keep(self, p, post_forward) -> torch.Tensor:
        raise FSDPUsageError(
            f"parameter '{p.fqn}' defines fsdp_pre_all_gather, whose all-gather cannot "
            "run over fewer ranks in backward; use reshard_after_forward=True or False"
        )

    def free(self, p) -> None:
        """Free what the unshard allocated (``reshard``)."""
        for storage, _ in self.storages:
            storage.resize_(0)

    def local_grad(self, grad: torch.Tensor, reduce_dtype: torch.dtype) -> torch.Tensor:
        """A gradient that is a tensor subclass, as a plain tensor (rows, *rest)."""
        if hasattr(grad, "__tensor_flatten__"):
            grad = torch.empty(grad.shape, dtype=reduce_dtype, device=self.device).copy_(
                grad
            )  # (rows, *rest)
        return super().local_grad(grad, reduce_dtype)
