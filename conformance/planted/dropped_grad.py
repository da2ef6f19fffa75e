"""Planted bug: the last parameter of every group never gets its gradient reduced."""

from twinshard.reference.sharded_param import ShardedParam

from . import plant
from ._common import *  # noqa: F401,F403


class DroppedGrad(ShardedParam):
    def reduce_scatter_input(self):
        super().reduce_scatter_input()  # taken, then thrown away instead of reduced
        return None


fully_shard = plant(bug_param_class=DroppedGrad, which=lambda params: params[-1:])
