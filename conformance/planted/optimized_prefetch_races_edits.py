"""Planted bug (optimized): a prefetch leaves the current stream free to overtake its copy-in,
so user code that writes a group's shards before the group computes (a forward pre-hook
registered with ``prepend=True``) races the copy-in that reads them: on an accelerator the
forward may see the old values, the new ones or a mixture. Stand-in streams report the write
(``edit_between_forwards``, run with ``--stand-in-streams``); on the CPU the copy-in is done
before the write and nothing shows."""

from twinshard.optimized.flat_group import FlatParamGroup

from . import plant
from ._optimized import *  # noqa: F401,F403
from ._optimized import optimized_fully_shard


class RacesEdits(FlatParamGroup):
    def prefetch(self, order_now: bool = True) -> bool:
        self.unshard_async()  # no ordering of the current stream after the copy-in
        self.watch_for_edits()  # the hooks watch only what they were told was issued
        return False  # so the hooks do not order it either


fully_shard = plant(bug_group_class=RacesEdits, base=optimized_fully_shard)
