"""Planted cost: ``set_requires_gradient_sync(False)`` is accepted and ignored, so the gradients
are reduced on every micro-batch. Each micro-batch's mean is added to the sharded gradient, so
the sums come out as they should: no value changes, and gradient accumulation pays the whole
communication on every micro-batch."""

from twinshard.reference.param_group import ParamGroup

from . import ignored, plant
from ._common import *  # noqa: F401,F403


class SyncsEveryMicroBatch(ParamGroup):
    reduce_grads = ignored(True)  # set_requires_gradient_sync(False) goes nowhere


fully_shard = plant(bug_group_class=SyncsEveryMicroBatch)
