"""Planted bug (optimized): a group computes without waiting for its all-gather and the copy
out of it (queued behind the all-gather on the copy-out stream).

On an accelerator the forward would read parameters the copy-out stream has not filled yet;
stand-in streams report the read as a race with the copy-out."""

import dataclasses

from twinshard.optimized.flat_group import FlatParamGroup

from . import plant
from ._optimized import *  # noqa: F401,F403
from ._optimized import optimized_fully_shard


class NoWait(FlatParamGroup):
    def wait_for_unshard(self):
        result = self.in_flight
        if result is not None:  # forget how to wait: as if the all-gather were done already
            pending = dataclasses.replace(result.pending, work=None, event=None)
            self.in_flight = result._replace(pending=pending)
            if result.pending.work is not None:
                result.pending.work.wait()  # gloo needs its work finished; the stream order does not
        super().wait_for_unshard()


fully_shard = plant(bug_group_class=NoWait, base=optimized_fully_shard)
