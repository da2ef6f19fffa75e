"""Planted bug (optimized): a group's unreduced gradients are released as soon as their pack is
queued on the reduce-scatter stream, not once the compute stream has waited for the reduction.
The pack may not have read them yet: on an accelerator the allocator could hand their memory to
the next block's backward; stand-in streams report the release as a race with the pack."""

from twinshard.optimized.flat_group import FlatParamGroup

from . import plant
from ._optimized import *  # noqa: F401,F403
from ._optimized import optimized_fully_shard


class DropsGradsAtPack(FlatParamGroup):
    def reduce_grads_now(self):
        comm = self.own_comm()
        before = len(comm.pending_reduce)
        super().reduce_grads_now()
        for result, _ in comm.pending_reduce[before:]:
            if result.grads is not None:
                comm.streams.release(result.grads, "planted release at the pack")
                result.grads = None


fully_shard = plant(bug_group_class=DropsGradsAtPack, base=optimized_fully_shard)
