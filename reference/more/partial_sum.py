"""Second reading. HSDP without an all-reduce at every backward: partial sums.

With HSDP a gradient is reduce-scattered inside a replica and then all-reduced across the
replicas. Under gradient accumulation, ``set_requires_all_reduce(False)`` skips the all-reduce
for the micro-batches before the last: each reduce-scattered block (chunk, *rest) is kept in the
parameter's layout and added to the next one, and only the last micro-batch all-reduces the
sum. The core calls ``ShardedParam.combine_partial_sum`` between the two collectives
(``ParamGroup.reduce_param``; the optimized path calls it after its batched reduce-scatter),
and every parameter on a 2D mesh has the ``PartialSums`` layout that answers it.
"""

from __future__ import annotations

import torch

from ..layout import Layout


class PartialSums(Layout):
    """The layout of a parameter on an HSDP mesh: it keeps back what was not all-reduced."""

    def setup(self, **_) -> None:
        self.partial_sum: torch.Tensor | None = None  # reduce-scattered, not all-reduced

    def combine_partial_sum(self, block: torch.Tensor, all_reduce: bool) -> torch.Tensor | None:
        """Add to ``block`` (chunk, *rest), in place, what earlier backwards reduce-scattered
        without all-reducing. Returns the block to all-reduce now, or None when
        ``all_reduce`` is False: then the sum is kept for the next backward."""
        if self.partial_sum is not None:
            block += self.partial_sum  # (chunk, *rest)
            self.partial_sum = None
        if not all_reduce:
            self.partial_sum = block
            return None
        return block

    def discard(self) -> None:
        self.partial_sum = None
        super().discard()
