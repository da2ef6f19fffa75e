"""Planted bug (optimized): after ``set_post_optim_event`` the copy-in waits only on that event,
even where the compute stream wrote shards after it: blocks moved into the group's storage,
parameters the user gave new memory (``load_state_dict(assign=True)``). On an accelerator the
copy-in could read those shards before they are written (issue 23, hazard 5); stand-in streams
report the read as a race. It shows only where shards are written after the event, as in the
fuzzer's examples with a ``reload`` (``twinshard.conformance.fuzz``), on stand-in streams."""

from twinshard.optimized.flat_group import FlatParamGroup

from . import plant
from ._optimized import *  # noqa: F401,F403
from ._optimized import optimized_fully_shard


class EventOnly(FlatParamGroup):
    def keep_shards(self):
        kept = super().keep_shards()
        self.moved_blocks = False  # forget that the compute stream just wrote the blocks
        return kept

    def replaced_since_gather(self, params):
        super().replaced_since_gather(params)  # the new parameters are still adopted
        return False  # forget that the user wrote them after the event


fully_shard = plant(bug_group_class=EventOnly, base=optimized_fully_shard)
