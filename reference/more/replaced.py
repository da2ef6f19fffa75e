"""Second reading. Sharded parameters that the user replaced, or left on the meta device.

A sharded parameter is a ``DTensor`` on the module, and torch's ways of filling a model do not
always write into it: ``model.to_empty(device=...)``, ``load_state_dict(assign=True)`` and DCP
put a new ``DTensor`` on the module instead. So before each all-gather the core asks
``ShardedParam.refresh``, which calls ``adopt_replaced`` here: a replacement of the same shape
becomes the sharded parameter from then on; anything else is refused by name, and so is a
parameter still on meta. ``check_materialized`` refuses meta parameters once, at the root's
first forward, naming them as torch's ``fully_shard`` does; ``on_meta`` serves it and the
optimized path.
"""

from __future__ import annotations

from torch.distributed.tensor import DTensor

from twinshard.api import FSDPUsageError


def adopt_replaced(p) -> None:
    """Make the module's parameter the sharded parameter of ``p`` (a ``ShardedParam``) if the
    user replaced it, refusing one that is no ``DTensor`` of the same shape, or on meta; move
    an offloaded shard that moved with the module (``to_empty``) back to host memory."""
    current = p.owners[0][0]._parameters[p.owners[0][1]]
    if current is not p.sharded_param:
        if not isinstance(current, DTensor) or current.shape != p.shape:
            raise FSDPUsageError(
                f"parameter '{p.fqn}' was replaced by a {type(current).__name__} of shape "
                f"{tuple(current.shape)} outside fully_shard; load values with "
                "load_state_dict or copy_ into the existing DTensor instead"
            )
        p.sharded_param = current
        p._register(current)
    if p.sharded_param.is_meta:
        raise FSDPUsageError(
            f"parameter '{p.fqn}' is still on the meta device; materialize it first, "
            "e.g. model.to_empty(device=...) and then initialize or load the weights"
        )
    local = p.sharded_param._local_tensor
    if local.device != p.shard_device:  # offloaded, then moved with the module (to_empty)
        local = local.to(p.shard_device)
        p.sharded_param._local_tensor = local.pin_memory() if p.pin else local


def on_meta(p) -> bool:
    """Whether the module's parameter of ``p`` (the sharded one, or one that replaced it) is
    on the meta device."""
    module, name = p.owners[0]
    return module._parameters[name].is_meta


def check_materialized(states: list) -> None:
    """Refuse parameters still on the meta device in the ``FSDPState``s of a root, naming
    those of the first group that has any, as torch's ``fully_shard`` does (its tests match
    the words), and counting the others."""
    groups = [s.group.params for s in states if s.group is not None]
    meta = [[p.fqn for p in params if on_meta(p)] for params in groups]
    meta = [names for names in meta if names]
    if meta:
        more = sum(map(len, meta[1:]))
        raise FSDPUsageError(
            "FSDP parameters should be materialized from meta device before training, but "
            f"the following were still on meta device: {meta[0]}"
            + (f" (and {more} more in other groups)" if more else "")
            + "; materialize them first, e.g. model.to_empty(device=...), then initialize "
            "or load the weights"
        )
