"""The optimized path keeps each parameter's block padded, in storage of its group.

``KeptBlocks`` is the part of ``FlatParamGroup`` (``flat_group.py``) that keeps the blocks: at
each unshard its all-gather takes them, flat and padded, as they are (``kept_shards``), and
moves them in again where the user gave a parameter new memory. It reaches each parameter only
through the contract: ``ShardedParam.layout.plain`` (a block that can live in the group's
storage), ``local_shard`` (where it lives now), ``adopt_local`` (make a view of the storage
the sharded ``DTensor``'s local tensor) and ``refresh``.
"""

from __future__ import annotations

import torch

from twinshard.api import without_grad
from twinshard.api.arguments import on_meta
from twinshard.dispatch.storages import memory_key, starts
from twinshard.reference.param_group import ParamGroup
from twinshard.reference.sharded_param import ParamState

SHARDED = ParamState.SHARDED  # read at every unshard: see ``flat_group.py``


def storage_shape(p) -> torch.Size | None:
    """The (chunk, *rest) tensor a group keeps the block of ``p`` (a ``ShardedParam``) in, or
    None where the shard cannot live in a group's storage: a layout of the second reading (a
    tensor-parallel piece, a ``Shard(dim)`` block, a shard offloaded to the host of an
    accelerator) and a tensor subclass or a shard with the all-gather extension, asked at
    each call."""
    local = p.local_shard
    if not p.layout.plain or hasattr(local, "__tensor_flatten__"):
        return None
    return None if hasattr(local, "fsdp_pre_all_gather") else p.block_shape


def keep_in(p, storage: torch.Tensor) -> torch.Tensor:
    """Move the block of ``p`` into ``storage`` (chunk, *rest), in the sharded parameter's
    dtype: the block fills its first ``local_rows`` rows, the padding rows are zeroed, and the
    sharded ``DTensor`` takes that view as its local tensor (``adopt_local``), which it
    returns. The ``DTensor`` stays the same object, so an optimizer holding it steps the
    storage from now on."""
    p.refresh()  # a replaced parameter is adopted first; a meta one is refused
    kept = storage.narrow(0, 0, p.local_rows)  # (local_rows, *rest)
    kept.copy_(p.local_shard)
    storage.narrow(0, p.local_rows, p.chunk - p.local_rows).zero_()  # the padding
    p.adopt_local(kept)
    return kept


def is_kept(p, kept: torch.Tensor | None) -> bool:
    """Whether the module's sharded parameter of ``p`` still lives in ``kept``, where
    ``keep_in`` put it. ``load_state_dict(assign=True)``, ``to_empty`` or ``module.to`` give it
    new memory; loading values in place (``load_state_dict``, DCP, ``copy_``) keeps it there."""
    return (
        p.held is p.sharded_param
        and p.local_shard is kept
        and not hasattr(kept, "fsdp_pre_all_gather")  # set on it since
    )


class KeptBlocks(ParamGroup):
    """The kept blocks of a ``FlatParamGroup``: see [Note: the group keeps its blocks padded]."""

    def setup_kept_blocks(self, one_mesh: bool, kept: list | None = None) -> None:
        """Decide whether the group can keep its blocks, and keep them now. Not for a group of
        mixed dtypes (a frozen float8 weight beside float32 ones: its blocks are gathered as
        bytes, each from its own tensor), nor one on several meshes (``meshes.py``). ``kept``:
        each parameter's block and view, where it is kept already (``split_off``)."""
        dtypes = [p.sharded_param.dtype for p in self.params]
        self.can_keep_shards = one_mesh and dtypes.count(dtypes[0]) == len(dtypes)
        self.can_keep_shards &= all(storage_shape(p) is not None for p in self.params)
        # per parameter: its padded block, flat, (chunk * rest,); None until it moves in
        self.kept_blocks: list = [None] * len(self.params)
        self.kept_views: list = [None] * len(self.params)  # its first local_rows rows
        if kept is not None:
            self.kept_blocks, self.kept_views = [b for b, _ in kept], [v for _, v in kept]
        self.kept_dtypes: list = []  # their compute dtypes; set when they move in
        self.gathered_kept = False  # whether the last all-gather took every block as kept
        self.moved_blocks = False  # keep_shards moved blocks since the last all-gather
        numels = [p.block_shape.numel() for p in self.params]
        self.kept_numel = sum(numels)  # all blocks, per rank
        self.keep_shards_now()  # see [Note: the kept blocks alias the sharded parameters]

    def kept_shards(self, params: list) -> tuple[list, int] | None:
        """Each parameter's padded block, flat, in storage the group keeps, ready to be
        concatenated into the all-gather as they are, and their total numel; None where each
        block is taken through ``all_gather_inputs`` (a group that cannot be kept so, of mixed
        dtypes, or with only a post-forward piece to gather).

        [Note: the group keeps its blocks padded]
        Each parameter's block lives padded to ``chunk`` rows in a tensor the group allocated,
        and the sharded ``DTensor``'s local tensor is a view of its first rows
        (``keep_in``), so the optimizer steps that tensor. The copy-in is then
        one concatenation (with the cast to the compute dtype) instead of taking, padding and
        flattening each block at every unshard, which on small parameters costs more than the
        data it moves. Blocks are moved in at the first unshard, and again for a parameter the
        user gave new memory since (``is_kept``). One tensor per parameter,
        not one buffer for the group: a view at an offset into a larger storage cannot be
        pickled once ``state_dict`` detaches it (torch.save of such a ``DTensor`` fails), while
        a view of the first rows can; DCP saves only the view."""
        if not self.can_keep_shards or len(params) != len(self.params):
            return None
        for p in params:  # loops, not any()/all() over generators: a group checks at every unshard
            if p.state is not SHARDED:
                return None
        for p, kept in zip(params, self.kept_views):
            if not is_kept(p, kept):
                return self.keep_shards()
        return self.kept_blocks, self.kept_numel

    def param_dtypes(self, params: list) -> list:
        """The reference's ``param_dtypes``; for the whole group, when its last all-gather
        took every block as kept, the dtypes found when they moved in, without asking each
        ``DTensor`` again. A kept block cannot change dtype, and the gradients to reduce were
        computed from that all-gather. The reductions ask twice per step (``reduce_dtypes``)."""
        if params is self.params and self.gathered_kept:
            return self.kept_dtypes
        return super().param_dtypes(params)

    def keep_shards(self) -> tuple[list, int] | None:
        """Move every block not yet kept (or given new memory since) into a new tensor of
        the group, in the parameter's dtype, as ``kept_shards`` returns them; None for a group
        whose dtypes became mixed."""
        for p in self.params:
            p.refresh()  # adopt parameters the user replaced, before their dtype is read
            if storage_shape(p) is None:  # the all-gather extension, set on it since
                self.can_keep_shards = False  # its shard gathers itself from now on
                return None
        dtypes = [p.sharded_param.dtype for p in self.params]
        if dtypes.count(dtypes[0]) != len(dtypes):
            return None
        for i, p in enumerate(self.params):
            if not is_kept(p, self.kept_views[i]):
                storage = self.storage_for(i, p, dtypes[0])  # (chunk, *rest)
                self.kept_views[i] = keep_in(p, storage)
                self.kept_blocks[i] = storage.view(-1)  # (chunk * rest,)
                self.moved_blocks = True  # on the current stream: the copy-in waits for it
        self.kept_dtypes = super().param_dtypes(self.params)  # compute dtypes, asked anew
        return self.kept_blocks, self.kept_numel

    @without_grad
    def keep_shards_now(self) -> None:
        """Move the blocks into the group's storage now, not at the next unshard: called when
        the group is made and whenever the module's sharded parameters may have been given new
        tensors (the module's conversions: ``to``, ``float``, ``to_empty``; a load with
        ``assign=True``). Nothing to do for a group that cannot keep its blocks, or while a
        parameter is still on the meta device (``to_empty`` comes back here).

        [Note: the kept blocks alias the sharded parameters]
        What a user holds of a sharded parameter's data (a ``state_dict()`` or
        ``get_model_state_dict`` taken before the first step, ``to_local()``, ``.data``, a
        ``detach()``) is a view of the local tensor it had at that moment. Trainers rely on it
        staying the parameter's: torchtitan takes the model's state dict once, before its first
        step, and saves that dict at every checkpoint. Moving a block into new storage at the
        first unshard left every such view with the initial values (and writes through it
        lost). So the storage is taken here, at the two moments torch's ``fully_shard`` pads
        too (construction, and after anything that replaced the local tensor), and never
        again behind the user's back. A block that already is a whole padded block of its own
        (rows divide evenly, contiguous, on the device, in the group's dtype) is adopted as
        it is, with no copy: a tensor loaded with ``assign=True`` stays the parameter's, as
        under torch. Only a parameter replaced outside these moments (the module's parameter dict
        written directly) is moved at its next unshard, as before."""
        if not self.can_keep_shards or any(on_meta(p) for p in self.params):
            return
        self.wait_for_unshard()  # an all-gather in flight reads the blocks being replaced
        self.keep_shards()

    def storage_for(self, i: int, p, dtype: torch.dtype) -> torch.Tensor:
        """Where parameter ``i``'s block is kept from now on, (chunk, *rest): its old storage
        when the local tensor still starts it (a conversion that changed nothing), the local
        tensor itself when it is a whole padded block that no other parameter keeps (rows that
        divide evenly; see [Note: the kept blocks alias the sharded parameters]), else new."""
        local, old = p.sharded_param.to_local(), self.kept_blocks[i]  # a view: the same memory
        shape = storage_shape(p)  # ``refresh`` put ``local`` on the device, in ``dtype``
        if not local.is_contiguous():
            return torch.empty(shape, dtype=dtype, device=self.device)
        if old is not None and starts(local, old) and old.dtype == dtype:
            return old.view(shape)
        memory = memory_key(local)
        others = [memory_key(b) for k, b in enumerate(self.kept_blocks) if k != i and b is not None]
        if local.shape == shape and local.storage_offset() == 0 and memory not in others:
            return local
        return torch.empty(shape, dtype=dtype, device=self.device)
