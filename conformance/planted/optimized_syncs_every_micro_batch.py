"""Planted cost (optimized): ``syncs_every_micro_batch``'s group in the optimized path: the
gradients of every micro-batch are reduce-scattered, though gradient sync is off."""

from twinshard.optimized.flat_group import FlatParamGroup

from . import plant
from ._optimized import *  # noqa: F401,F403
from ._optimized import optimized_fully_shard
from .syncs_every_micro_batch import SyncsEveryMicroBatch


class OptimizedSyncsEveryMicroBatch(SyncsEveryMicroBatch, FlatParamGroup):
    """The property of ``SyncsEveryMicroBatch`` on top of ``FlatParamGroup``."""


fully_shard = plant(bug_group_class=OptimizedSyncsEveryMicroBatch, base=optimized_fully_shard)
