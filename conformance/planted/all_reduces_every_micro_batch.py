"""Planted cost (HSDP): ``set_requires_all_reduce(False)`` is accepted and ignored, so each
micro-batch's reduce-scattered gradients are all-reduced across the replicas at once instead of
adding up for one all-reduce on the last. The sums are the same; the traffic across replicas,
the slow link of HSDP, is paid on every micro-batch."""

from twinshard.reference.param_group import ParamGroup

from . import ignored, plant
from ._common import *  # noqa: F401,F403


class AllReducesEveryMicroBatch(ParamGroup):
    all_reduce_grads = ignored(True)  # set_requires_all_reduce(False) goes nowhere


fully_shard = plant(bug_group_class=AllReducesEveryMicroBatch)
