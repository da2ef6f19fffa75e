"""Second reading. HSDP without an all-reduce at every backward: partial sums.

With HSDP a gradient is reduce-scattered inside a replica and then all-reduced across the
replicas. Under gradient accumulation, ``set_requires_all_reduce(False)`` skips the all-reduce
for the micro-batches before the last: each reduce-scattered block (chunk, *rest) is kept here,
in the parameter's ``partial_sum``, and added to the next one, and only the last micro-batch
all-reduces the sum. The core calls ``ShardedParam.combine_partial_sum`` between the two
collectives (``ParamGroup.reduce_param``; the optimized path calls it after its batched
reduce-scatter), and that method calls ``combine_partial_sum`` here.
"""

from __future__ import annotations

import torch


def combine_partial_sum(p, block: torch.Tensor, all_reduce: bool) -> torch.Tensor | None:
    """Add to ``block`` (chunk, *rest), in place, what earlier backwards of ``p`` (a
    ``ShardedParam``) reduce-scattered without all-reducing. Returns the block to all-reduce
    now, or None when ``all_reduce`` is False: then the sum is kept for the next backward."""
    if p.partial_sum is not None:
        block += p.partial_sum  # (chunk, *rest)
        p.partial_sum = None
    if not all_reduce:
        p.partial_sum = block
        return None
    return block
