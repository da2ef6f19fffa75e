"""Second reading. A parameter's layout, chosen from the features it needs.

``ShardedParam`` asks its ``Layout`` (``layout.py``) at the moments where features differ.
``fully_shard`` chooses it once (``choose_layout``): the plain one, or a class made of the
features the parameter needs, each a subclass of the plain layout that changes what it must
and passes the rest on with ``super()``, in this order:

    Extension       a shard that gathers itself (extension.py)
    TensorParallel  a DTensor parameter: FSDP cuts its tensor-parallel piece (tensor_parallel.py)
    ShardDim        shard_placement_fn's Shard(dim), dim > 0 (below)
    Offload         the shard in host memory (offload.py)
    PartialSums     HSDP's sums kept back between backwards (below)

A tensor-parallel ``Shard(1)`` weight's unsharded parameter is the ``DTensor`` (TensorParallel)
of a contiguous copy (ShardDim) of the gathered rows (plain). A shard may get ``fsdp_pre_all_gather`` after it was sharded (after ``to_empty``): the extension
is added when ``ShardedParam.refresh`` finds it (``layout_for_shard``), before an all-gather.

Parameters the user replaced: ``model.to_empty(device=...)``, ``load_state_dict(assign=True)``
and DCP put a new ``DTensor`` on the module. Before each all-gather ``ShardedParam.refresh``
adopts a replacement of the same shape; anything else, and a parameter still on meta, is
refused by name (``twinshard/api/arguments.py``).
"""

from __future__ import annotations

from functools import cache

import torch
from torch.distributed.tensor import DTensor

from twinshard.api import CPUOffloadPolicy
from twinshard.api.arguments import check_replacement

from ..layout import Layout
from .extension import Extension, gathers_itself
from .offload import Offload
from .tensor_parallel import ShardDim, TensorParallel


class PartialSums(Layout):
    """HSDP's sums kept back: with ``set_requires_all_reduce(False)`` (micro-batches before
    the last) each reduce-scattered block waits here, added to the next, unreduced."""

    def setup(self, **_) -> None:
        self.partial_sum: torch.Tensor | None = None  # (chunk, *rest) not all-reduced yet

    def combine_partial_sum(self, block: torch.Tensor, all_reduce: bool) -> torch.Tensor | None:
        """``block`` (chunk, *rest) plus the sum kept back, to all-reduce now; None (the sum
        kept for the next backward) when ``all_reduce`` is False."""
        if self.partial_sum is not None:
            block += self.partial_sum  # (chunk, *rest)
            self.partial_sum = None
        if not all_reduce:
            self.partial_sum = block
            return None
        return block

    def discard(self) -> None:
        self.partial_sum = None


ORDER = (Extension, TensorParallel, ShardDim, Offload, PartialSums)


@cache
def composed(features: tuple[type, ...]) -> type:
    """One layout class of ``features`` (in ``ORDER``), made once per combination."""
    return (
        features[0]
        if len(features) == 1
        else type("".join(f.__name__ for f in features), features, {})
    )


def choose_layout(param, info, device: torch.device, dim: int, offload, mp, fqn: str) -> Layout:
    """The layout of ``param`` (named ``fqn``) sharded over ``info`` (a ``MeshInfo``) on
    ``Shard(dim)``, with the group's ``offload`` and ``mp`` policies; each feature's ``setup``
    fills its own fields."""
    wanted = {
        TensorParallel: isinstance(param, DTensor),
        ShardDim: dim != 0,
        Offload: isinstance(offload, CPUOffloadPolicy),
        PartialSums: info.replicate_group is not None,
    }
    features = tuple(f for f in ORDER if wanted.get(f))
    if not features:
        return Layout(device, mp)
    layout = composed(features)(device, mp)
    for feature in features:
        feature.setup(layout, param=param, info=info, dim=dim, offload=offload, fqn=fqn)
    return layout


def layout_for_shard(p, current) -> Layout:
    """The layout of ``p`` (a ``ShardedParam``) for ``current``, the parameter its module holds
    now: ``p``'s, with the extension first where ``current``'s shard gathers itself (fields
    carried over). A replacement that is no ``DTensor`` of ``p``'s shape (``to_empty``,
    ``load_state_dict(assign=True)`` and DCP put new ones), or one on meta, is refused."""
    if current is not p.sharded_param or current.is_meta:
        check_replacement(p.fqn, p.shape, current)  # a DTensor of its shape, not on meta
    layout = p.layout
    if isinstance(layout, Extension) or not gathers_itself(p, current._local_tensor):
        return layout
    cls = composed((Extension, *(f for f in ORDER if isinstance(layout, f))))
    extended = cls.__new__(cls)
    extended.__dict__.update(layout.__dict__)
    Extension.setup(extended)
    return extended
