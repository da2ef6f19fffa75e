"""Planted cost: ``set_unshard_in_backward(False)`` is accepted and ignored, so a module whose
backward needs no weights (an embedding) is all-gathered again in backward for nothing."""

from twinshard.reference.param_group import ParamGroup

from . import ignored, plant
from ._common import *  # noqa: F401,F403


class GathersInBackward(ParamGroup):
    unshard_in_backward = ignored(True)  # set_unshard_in_backward(False) goes nowhere


fully_shard = plant(bug_group_class=GathersInBackward)
