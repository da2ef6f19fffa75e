"""Planted bug (optimized): each block moves into the group's storage at its first all-gather,
not when the group is made, and a parameter given a new local tensor (``module.to``,
``float()``, ``to_empty``, ``load_state_dict(assign=True)``) moves at its next all-gather,
always into new memory. Training is unchanged; what the user took of a parameter before
(``state_dict()``, ``to_local()``, a checkpointer's cached state dict) silently keeps the old
values. The ``views_*`` cases catch it."""

import torch

from twinshard.optimized.flat_group import FlatParamGroup
from twinshard.optimized.kept_blocks import storage_shape

from . import plant
from ._optimized import *  # noqa: F401,F403
from ._optimized import optimized_fully_shard


class MovesLate(FlatParamGroup):
    def keep_shards_now(self):
        pass

    def storage_for(self, i, p, dtype):
        return torch.empty(storage_shape(p), dtype=dtype, device=self.device)


def undo_early_keep(group):
    """The blocks were kept when the group was made: give each parameter its own copy again,
    so that the first all-gather moves it, as before the fix."""
    for p in group.params:
        local = p.sharded_param._local_tensor
        p.sharded_param._local_tensor = local.clone()


fully_shard = plant(bug_group_class=MovesLate, after=undo_early_keep, base=optimized_fully_shard)
