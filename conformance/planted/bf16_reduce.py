"""Planted bug: gradients are reduced in bf16 even when the policy asks for fp32."""

import torch

from twinshard.reference.param_group import ParamGroup

from . import plant
from ._common import *  # noqa: F401,F403


class Bf16Reduce(ParamGroup):
    def reduce_dtypes(self, params):
        if self.mp.param_dtype is not None:
            return [torch.bfloat16] * len(params)
        return super().reduce_dtypes(params)


fully_shard = plant(bug_group_class=Bf16Reduce)
