"""Planted bug (optimized): with HSDP and ``set_requires_all_reduce(False)``, the partial sum of
earlier micro-batches is replaced instead of added to, so only the last one counts."""

from twinshard.reference.sharded_param import ShardedParam

from . import plant
from ._optimized import *  # noqa: F401,F403
from ._optimized import optimized_fully_shard


class DroppedPartial(ShardedParam):
    def combine_partial_sum(self, block, all_reduce):
        self.layout.partial_sum = None  # the earlier micro-batches' sums are lost
        return super().combine_partial_sum(block, all_reduce)


fully_shard = plant(bug_param_class=DroppedPartial, base=optimized_fully_shard)
