"""Planted bug: every reduced gradient comes out 1.001 times too large."""

from twinshard.reference.sharded_param import ShardedParam

from . import plant
from ._common import *  # noqa: F401,F403


class ScaledGrad(ShardedParam):
    def accumulate_grad(self, block):
        super().accumulate_grad(block * 1.001)


fully_shard = plant(bug_param_class=ScaledGrad)
