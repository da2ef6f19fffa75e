"""Planted bug (optimized): the all-gather buffer is released right after the all-gather is
issued, before the copy-out has read it. On an accelerator the allocator could hand the memory
to the next allocation; stand-in streams report the copy-out as a use after release."""

from twinshard.optimized.flat_group import FlatParamGroup

from . import plant
from ._optimized import *  # noqa: F401,F403
from ._optimized import optimized_fully_shard


class EarlyRelease(FlatParamGroup):
    def unshard_async(self):
        super().unshard_async()
        if self.in_flight is not None:
            self.comm.streams.release([self.in_flight.recv], "planted early release")


fully_shard = plant(bug_group_class=EarlyRelease, base=optimized_fully_shard)
