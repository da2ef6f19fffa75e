"""Planted cost: nothing is resharded after forward, whatever ``reshard_after_forward`` says, so
every group stays unsharded from its forward to its backward (which then gathers nothing).
The values are those of ``reshard_after_forward=False``: the memory that the default setting
was chosen to save is spent."""

from twinshard.reference.param_group import ParamGroup, TrainingState

from . import plant
from ._common import *  # noqa: F401,F403


class KeepsAfterForward(ParamGroup):
    def post_forward(self):
        self.state = TrainingState.IDLE  # no reshard


fully_shard = plant(bug_group_class=KeepsAfterForward)
