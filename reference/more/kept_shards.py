"""Second reading. A shard kept in storage the caller owns: offered to ``twinshard.optimized``.

The reference keeps each parameter's block on its own and does not call these. The optimized
path keeps a group's blocks padded to ``chunk`` rows, each in a tensor of the group, so that
its all-gather concatenates them as they are (``optimized/flat_group.py``). Three functions of
a ``ShardedParam`` serve it: ``shard_storage_shape`` says whether and in what shape the block
can move into such a tensor, ``keep_shard_in`` moves it there, ``shard_is_kept`` says at each
unshard whether it still lives there. They belong to the contract between the two trees
(docs/concepts.md).
"""

from __future__ import annotations

import torch


def shard_storage_shape(p) -> torch.Size | None:
    """The (chunk, *rest) tensor ``keep_shard_in`` takes for ``p``, or None where the shard
    cannot live in a caller's storage: a tensor-parallel parameter, a ``Shard(dim)`` with
    dim > 0 (its block is not whole rows of memory), an offloaded one (its shard stays on the
    host while the all-gather runs on the compute device) and a tensor subclass or a shard
    with the all-gather extension (``extension.py``), asked at each call."""
    local = p.sharded_param._local_tensor
    if p.tp is not None or p.dim != 0 or p.shard_device != p.device:
        return None
    if hasattr(local, "__tensor_flatten__") or hasattr(local, "fsdp_pre_all_gather"):
        return None
    return p.block_shape


def keep_shard_in(p, storage: torch.Tensor) -> None:
    """Move the block of ``p`` into ``storage`` (chunk, *rest), a tensor the caller owns, in
    the sharded parameter's dtype: the block fills its first ``local_rows`` rows, the padding
    rows are zeroed, and the sharded ``DTensor`` takes that view as its local tensor. The
    ``DTensor`` stays the same object, so an optimizer holding it steps the storage from now
    on."""
    p.refresh()  # a replaced parameter is adopted first; a meta one is refused
    kept = storage.narrow(0, 0, p.local_rows)  # (local_rows, *rest)
    kept.copy_(p.sharded_param._local_tensor)
    storage.narrow(0, p.local_rows, p.chunk - p.local_rows).zero_()  # the padding
    p.sharded_param._local_tensor = kept
    p.kept_local, p.extended = kept, False  # a kept block is a plain one


def shard_is_kept(p) -> bool:
    """Whether the module's sharded parameter of ``p`` still lives where ``keep_shard_in`` put
    it. ``load_state_dict(assign=True)``, ``to_empty`` or ``module.to`` give it new memory;
    loading values in place (``load_state_dict``, DCP, ``copy_``) keeps it there."""
    module, name = p.owners[0]
    return (
        module._parameters[name] is p.sharded_param
        and p.sharded_param._local_tensor is getattr(p, "kept_local", None)
        and not hasattr(p.kept_local, "fsdp_pre_all_gather")  # set on it since
    )
