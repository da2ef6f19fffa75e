"""Planted cost: every group is resharded after forward, also where ``reshard_after_forward=False``
(or the root's default) keeps it for backward, which then all-gathers it again. The values are
those of the default setting; the user pays the memory they chose to spend and gets the
communication they chose to save."""

from twinshard.reference.param_group import ParamGroup, TrainingState

from . import plant
from ._common import *  # noqa: F401,F403


class ReshardsKept(ParamGroup):
    def post_forward(self):
        self.reshard(after_forward=self.post_forward_info is not None)  # kept or not: freed
        self.state = TrainingState.IDLE


fully_shard = plant(bug_group_class=ReshardsKept)
