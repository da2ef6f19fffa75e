"""Planted bug (optimized): an implicit forward prefetch never notices an edit of the shards it
read, so a group whose forward pre-hook (registered with ``prepend=True``) edits its sharded
parameters computes with the values from before the edit, unlike torch's default
``fully_shard`` (``edit_between_forwards`` with the default settings)."""

from twinshard.optimized.flat_group import FlatParamGroup

from . import plant
from ._optimized import *  # noqa: F401,F403
from ._optimized import optimized_fully_shard


class MissesEdits(FlatParamGroup):
    def watch_for_edits(self) -> None:
        pass  # the versions the prefetch read are never noted, so never compared


fully_shard = plant(bug_group_class=MissesEdits, base=optimized_fully_shard)
