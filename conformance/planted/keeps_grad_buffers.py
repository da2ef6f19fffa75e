"""Planted cost: each parameter keeps its padded gradient after reduce-scattering it, until the
next reduction replaces it: a whole unsharded copy of every gradient stays alive between steps,
which sharding the gradients was meant to save."""

from twinshard.reference.sharded_param import ShardedParam

from . import plant
from ._common import *  # noqa: F401,F403


class KeepsGradBuffers(ShardedParam):
    def reduce_scatter_input(self, dtype):
        self.kept_buffer = super().reduce_scatter_input(dtype)  # (S * chunk, *rest), kept
        return self.kept_buffer


fully_shard = plant(bug_param_class=KeepsGradBuffers)
