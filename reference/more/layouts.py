"""Second reading. Choosing a parameter's layout, from the features it needs.

A ``ShardedParam`` asks its ``Layout`` (``layout.py``) at the three moments where features
differ. ``fully_shard`` chooses the layout once, here, when it shards the parameter: the plain
one, or a class made of the features the parameter needs, in this order, each a subclass of
the plain layout that changes what it must and passes the rest on (``super()``):

    Extension       the shard gathers itself (extension.py); chosen at an unshard, see below
    TensorParallel  a DTensor parameter: FSDP cuts its tensor-parallel piece (tensor_parallel.py)
    ShardDim        shard_placement_fn's Shard(dim) with dim > 0 (shard_dim.py)
    Offload         the shard in host memory (offload.py)
    PartialSums     HSDP's sums kept back between backwards (partial_sum.py)

The order matters where two features change the same moment: the unsharded parameter of a
tensor-parallel ``Shard(dim)`` weight is the ``DTensor`` (TensorParallel) of the contiguous copy
(ShardDim) of the gathered rows (the plain layout).

A shard may be given ``fsdp_pre_all_gather`` after it was sharded (after ``to_empty``), so the
all-gather extension is chosen when an unshard finds it: ``layout_for_shard``, which
``ShardedParam.refresh`` asks before each all-gather, also checks a replaced parameter.
"""

from __future__ import annotations

from functools import cache

import torch
from torch.distributed.tensor import DTensor

from twinshard.api import FSDPUsageError

from ..layout import Layout
from .extension import Extension, gathers_itself
from .offload import Offload
from .partial_sum import PartialSums
from .shard_dim import ShardDim
from .tensor_parallel import TensorParallel

ORDER = (Extension, TensorParallel, ShardDim, Offload, PartialSums)  # see the docstring


@cache
def composed(features: tuple[type, ...]) -> type:
    """One layout class of ``features`` (in ``ORDER``), made once per combination."""
    if len(features) == 1:
        return features[0]
    return type("".join(f.__name__ for f in features), features, {})


def choose_layout(param, info, device: torch.device, dim: int, offload, mp, fqn: str) -> Layout:
    """The layout of ``param`` (an ``nn.Parameter``, named ``fqn`` in errors) sharded over
    ``info`` (a ``MeshInfo``) on ``Shard(dim)``, with the group's ``offload`` (a
    ``CPUOffloadPolicy`` or None) and ``mp`` policy. Each feature's ``setup`` fills its own
    fields."""
    wanted = {
        TensorParallel: isinstance(param, DTensor),
        ShardDim: dim % param.dim() != 0 if param.dim() else False,
        Offload: offload is not None,
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
    """The layout of ``p`` (a ``ShardedParam``) for the parameter ``current`` the module holds
    now: ``p``'s, with the all-gather extension first where ``current``'s shard gathers itself
    (its fields carried over). A replacement that is no ``DTensor`` of ``p``'s shape, or a
    parameter still on meta, is refused by name."""
    if current is not p.sharded_param and (
        not isinstance(current, DTensor) or current.shape != p.shape
    ):
        raise FSDPUsageError(
            f"parameter '{p.fqn}' was replaced by a {type(current).__name__} of shape "
            f"{tuple(current.shape)} outside fully_shard; load values with "
            "load_state_dict or copy_ into the existing DTensor instead"
        )
    if current.is_meta:
        raise FSDPUsageError(
            f"parameter '{p.fqn}' is still on the meta device; materialize it first, "
            "e.g. model.to_empty(device=...) and then initialize or load the weights"
        )
    layout = p.layout
    if isinstance(layout, Extension) or not gathers_itself(p, current._local_tensor):
        return layout
    features = (Extension, *(f for f in ORDER if isinstance(layout, f)))
    extended = composed(features).__new__(composed(features))
    extended.__dict__.update(layout.__dict__)
    Extension.setup(extended)
    return extended
