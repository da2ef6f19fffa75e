"""Planted cost: with ``param_dtype=bfloat16`` the parameters are all-gathered in float32 and
cast to bfloat16 afterwards. A cast commutes with gathering, so the unsharded parameters hold
exactly the same values: only twice the bytes cross the network (and a float32 copy of each
parameter is allocated for the moment of the cast)."""

import torch

from twinshard.reference.collectives import all_gather_rows
from twinshard.reference.param_group import ParamGroup
from twinshard.reference.sharded_param import ParamState

from . import plant
from ._common import *  # noqa: F401,F403


class GathersFp32(ParamGroup):
    def unshard_param(self, p, dtype):
        full = p.sharded_param.dtype
        if p.state is not ParamState.SHARDED or dtype == full:
            return super().unshard_param(p, dtype)
        out = p.all_gather_output(dtype)  # (S * chunk, *rest) in the compute dtype
        wide = torch.empty(out.shape, dtype=full, device=out.device)  # the same, in float32
        (block,) = p.all_gather_inputs(full)  # (chunk, *rest) in float32
        all_gather_rows(wide, block, p.info.shard_group, self.comms.all_gather, p.fqn)
        out.copy_(wide)  # cast after gathering
        p.finish_unshard()


fully_shard = plant(bug_group_class=GathersFp32)
