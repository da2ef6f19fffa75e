"""Planted bug: the last parameter of every group never gets its gradient reduced."""

from twinshard.reference.sharded_param import ShardedParam

from . import plant
from ._common import *  # noqa: F401,F403


class DroppedGrad(ShardedParam):
    def reduce_grad(self, divide_by, all_reduce):
        self.grad_to_reduce = None  # thrown away instead of reduced


fully_shard = plant(bug_param_class=DroppedGrad, which=lambda params: params[-1:])
