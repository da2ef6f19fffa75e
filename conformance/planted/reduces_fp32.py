"""Planted cost: gradients are reduced in float32 whatever the policy asks. With
``param_dtype=bfloat16`` and no ``reduce_dtype`` the reductions should run in bfloat16; in
float32 they carry twice the bytes (and are, if anything, more exact: no case that compares
values sees it)."""

import torch

from twinshard.reference.param_group import ParamGroup

from . import plant
from ._common import *  # noqa: F401,F403


class ReducesFp32(ParamGroup):
    def reduce_dtypes(self, params):
        return [torch.float32] * len(params)


fully_shard = plant(bug_group_class=ReducesFp32)
