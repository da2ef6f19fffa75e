"""Planted bug: each rank's shard is off by one row (every row holds its neighbour's values)."""

import torch

from . import plant
from ._common import *  # noqa: F401,F403


@torch.no_grad()
def _shift(group):
    for p in group.params:
        local = p.sharded_param.to_local()  # (rows on this rank, *rest)
        if local.shape[0] > 1:
            local.copy_(torch.roll(local, 1, dims=0))


fully_shard = plant(after=_shift)
