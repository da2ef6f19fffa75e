"""Planted bug (optimized): the reference's ``scaled_grads`` parameter class, planted in the
optimized path. ``accumulate_grad`` is a contract method of ``ShardedParam``: the optimized path
calls the same method, so the bug reaches it exactly as it reaches the reference."""

from . import plant
from ._optimized import *  # noqa: F401,F403
from ._optimized import optimized_fully_shard
from .scaled_grads import ScaledGrad

fully_shard = plant(bug_param_class=ScaledGrad, base=optimized_fully_shard)
