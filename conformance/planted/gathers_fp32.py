"""Planted cost: with ``param_dtype=bfloat16`` the parameters are all-gathered in float32 and
cast to bfloat16 afterwards. A cast commutes with gathering, so the unsharded parameters hold
exactly the same values: only twice the bytes cross the network (and a float32 copy of each
parameter is allocated for the moment of the cast)."""

import torch

from twinshard.reference.collectives import all_gather_rows
from twinshard.reference.sharded_param import ParamState, ShardedParam

from . import plant
from ._common import *  # noqa: F401,F403


class GathersFp32(ShardedParam):
    def unshard(self, dtype, post_forward, comm=None):
        full = self.sharded_param.dtype
        if self.state is not ParamState.SHARDED or dtype == full:
            return super().unshard(dtype, post_forward, comm)
        out = self.all_gather_output(dtype)  # (S * chunk, *rest) in the compute dtype
        wide = torch.empty(out.shape, dtype=full, device=out.device)  # the same, in float32
        all_gather_rows(wide, self.all_gather_input(full), self.info.shard_group, comm)
        out.copy_(wide)  # cast after gathering
        self.finish_unshard()


fully_shard = plant(bug_param_class=GathersFp32)
