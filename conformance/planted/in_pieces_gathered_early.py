"""Planted cost (the root in pieces): a parent prefetches its pieces at its own pre-forward, as
if they were still part of its group, instead of leaving each piece to the group that runs just
before it. Each piece still waits for its own all-gather, so no value changes; the output
layer's unsharded parameters are held through the whole forward, which the cut was meant to
avoid ([Note: the root's parameters in pieces])."""

from twinshard.optimized.in_pieces import *  # noqa: F401,F403
from twinshard.optimized.in_pieces import fully_shard as in_pieces_fully_shard
from twinshard.optimized.state import FSDPState

from . import plant


class PiecesAtTheStart(FSDPState):
    def prefetch_targets(self, hint, order):
        targets = super().prefetch_targets(hint, order)
        early = [p.group for p in self.pieces if p.group is not None]
        return targets + [g for g in early if g not in targets]


fully_shard = plant(bug_state_class=PiecesAtTheStart, base=in_pieces_fully_shard)
