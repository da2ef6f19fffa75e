"""Second reading. The contract's group-level methods, which ``ShardedParam`` inherits.

Each takes ``params``, a group's ``ShardedParam``s, and does for every one what the method it
names does: an implementation that moves a group as one (``twinshard.optimized``) makes one
call where the reference's ``ParamGroup`` makes one per parameter. A parameter of the plain
layout (``layout.py``, the identity) takes the step here, without the calls into its layout,
which on small parameters cost more than the work; any other is asked through its own method.
A parameter's ``type(p.state)`` is ``ParamState``, which ``sharded_param.py`` defines.
"""

import torch
from torch.distributed.tensor import DTensor

from ..layout import Layout


class GroupMethods:
    @staticmethod
    def all_gather_outputs_all(params: list, dtypes: list) -> list[torch.Tensor]:
        """``all_gather_outputs`` of each of ``params`` in its dtype of ``dtypes``, one list."""
        outs = []
        for p, dtype in zip(params, dtypes):
            if type(p.layout) is Layout and p.all_gather_buffer is not None:
                p.all_gather_storage.resize_(p.all_gather_bytes)  # its memory again, in place
                outs.append(p.all_gather_buffer)  # (S * chunk, *rest)
            else:
                outs += p.all_gather_outputs(dtype)
        return outs

    @staticmethod
    def finish_unshard_all(params: list) -> None:
        """``finish_unshard`` of each of ``params``."""
        for p in params:
            if type(p.layout) is not Layout:
                p.finish_unshard()
                continue
            p.post_forward_block, param = None, p.unsharded_param
            param.requires_grad_(p.sharded_param.requires_grad)
            for module, name in p.owners:
                module._parameters[name] = param
            p.state = type(p.state).UNSHARDED

    @staticmethod
    def reshard_all(params: list) -> None:
        """``reshard`` of each of ``params``, none keeping a piece for backward."""
        for p in params:
            if type(p.layout) is not Layout:
                p.reshard()
            elif p.state is type(p.state).UNSHARDED:
                p.all_gather_storage.resize_(0)  # the plain layout's ``free``
                for module, name in p.owners:
                    module._parameters[name] = p.sharded_param
                p.state = type(p.state).SHARDED

    @staticmethod
    def reduce_scatter_inputs(params: list, dtype: torch.dtype) -> tuple[list, list]:
        """``has_grad_to_reduce`` and ``reduce_scatter_input(dtype)`` of each of ``params``:
        whether it had a gradient here, and what it hands over (None: frozen)."""
        used, inputs = [], []
        for p in params:
            grad = p.grad_to_reduce  # (rows, *rest) or None
            used.append(grad is not None)
            rows = grad.shape[0] if grad is not None and type(p.layout) is Layout else None
            if rows == p.info.shard_size * p.chunk and grad.is_contiguous():
                p.grad_to_reduce = None
                inputs.append(grad)  # (S * chunk, *rest): no padding rows to add
            else:
                inputs.append(p.reduce_scatter_input(dtype))
        return used, inputs

    @staticmethod
    def accumulate_grads(params: list, blocks: list) -> None:
        """``accumulate_grad`` of each of ``params`` with its reduced block of ``blocks``;
        blocks added to gradients that exist go in one fused addition."""
        grads, added = [], []
        for p, block in zip(params, blocks):
            sharded = p.sharded_param
            grad, dtype = sharded.grad, sharded.dtype
            plain = type(p.layout) is Layout and p.local_rows == p.chunk
            same = block.dtype == dtype and (grad is None or grad.dtype == dtype)
            if not (plain and same) or sharded._post_accumulate_grad_hooks:
                p.accumulate_grad(block)
            elif grad is None:  # as ``accumulate_grad`` makes it: the parameter's own spec
                local = block.contiguous()  # (chunk, *rest)
                sharded.grad = DTensor.__new__(DTensor, local, sharded._spec, requires_grad=False)
            else:
                grads.append(grad.to_local())
                added.append(block)
        if grads:
            torch._foreach_add_(grads, added)
