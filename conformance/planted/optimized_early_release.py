"""Planted bug (optimized): the all-gather buffer is released before the copy out of it has
read it. On an accelerator the allocator could hand the memory to the next allocation; stand-in
streams report the copy-out as a use after release."""

from twinshard.optimized.collectives import CopyOut
from twinshard.optimized.comm import CommContext
from twinshard.optimized.flat_group import FlatParamGroup

from . import plant
from ._optimized import *  # noqa: F401,F403
from ._optimized import optimized_fully_shard


class ReleasesFirst(CommContext):
    def after(self, pending, stream, work):
        if isinstance(work, CopyOut):
            self.streams.release([work.recv], "planted early release")
        super().after(pending, stream, work)


class EarlyRelease(FlatParamGroup):
    def issue_all_gather(self):
        self.own_comm().__class__ = ReleasesFirst  # the shared context, for every group
        super().issue_all_gather()


fully_shard = plant(bug_group_class=EarlyRelease, base=optimized_fully_shard)
