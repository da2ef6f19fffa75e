"""Planted cost (optimized): every group still to run in this pass is prefetched at once, instead
of the next one. Each group waits for its own all-gather, so no value changes; the unsharded
parameters of the whole model are in flight together, which one group ahead was meant to avoid."""

from twinshard.optimized.state import FSDPState

from . import plant
from ._optimized import *  # noqa: F401,F403
from ._optimized import optimized_fully_shard


class PrefetchAll(FSDPState):
    def prefetch_targets(self, hint, order):
        if hint is not None or self.group not in order:
            return super().prefetch_targets(hint, order)
        return order[order.index(self.group) + 1 :]


fully_shard = plant(bug_state_class=PrefetchAll, base=optimized_fully_shard)
