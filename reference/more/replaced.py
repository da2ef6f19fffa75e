"""Second reading. Sharded parameters that the user replaced, or left on the meta device.

A sharded parameter is a ``DTensor`` on the module, and torch's ways of filling a model do not
always write into it: ``model.to_empty(device=...)``, ``load_state_dict(assign=True)`` and DCP
put a new ``DTensor`` on the module instead. So before each all-gather the core asks
``ShardedParam.refresh``: a replacement of the same shape becomes the sharded parameter from
then on; anything else is refused by name (``layouts.layout_for_shard``), and so is a parameter
still on meta. ``check_materialized`` refuses meta parameters once, at the root's first
forward, naming them as torch's ``fully_shard`` does; ``on_meta`` serves it and the optimized
path.
"""

from __future__ import annotations

from twinshard.api import FSDPUsageError


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
