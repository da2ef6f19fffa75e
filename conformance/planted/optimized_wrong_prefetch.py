"""Planted bug (optimized): prefetch two groups ahead instead of one, and a group that finds
no all-gather in flight for itself takes the one in flight for another group (as if there were
one prefetch slot, matched by position rather than by group). The blocks have the same shapes,
so it computes with another block's weights."""

from twinshard.optimized.flat_group import FlatParamGroup
from twinshard.optimized.state import FSDPState

from . import plant
from ._optimized import *  # noqa: F401,F403
from ._optimized import optimized_fully_shard


class TwoAhead(FSDPState):
    def prefetch_targets(self, hint, order):
        i = order.index(self.group) if self.group in order else len(order)
        return order[i + 2 : i + 3]


class TakesAnyPrefetch(FlatParamGroup):
    def unshard_async(self):
        others = self.comm.forward_order if self.comm is not None else []
        slot = next((g for g in others if g is not self and g.in_flight is not None), None)
        if self.in_flight is None and slot is not None:
            result, slot.in_flight = slot.in_flight, None
            self.in_flight = result._replace(params=self.params)
            return
        super().unshard_async()


fully_shard = plant(
    bug_group_class=TakesAnyPrefetch, bug_state_class=TwoAhead, base=optimized_fully_shard
)
