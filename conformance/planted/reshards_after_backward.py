"""Planted cost: ``set_reshard_after_backward(False)`` is accepted and ignored, so every group is
resharded after backward and the next micro-batch's forward all-gathers it again. The values
are the same; gradient accumulation that asked to keep the parameters pays one all-gather per
group and micro-batch."""

from twinshard.reference.param_group import ParamGroup

from . import ignored, plant
from ._common import *  # noqa: F401,F403


class ReshardsAfterBackward(ParamGroup):
    reshard_after_backward = ignored(True)  # set_reshard_after_backward(False) goes nowhere


fully_shard = plant(bug_group_class=ReshardsAfterBackward)
