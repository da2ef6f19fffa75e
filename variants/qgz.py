"""qgZ: gradients exchanged as block-quantized integers by all-to-all, reduced in fp32 (ZeRO++,
arXiv 2306.10209, 3.3).

A reduce-scatter's input is one chunk per rank (the values that rank keeps). Each rank
quantizes every chunk in blocks (``blocks.py``, per parameter), sends chunk r to rank r with
one all-to-all, dequantizes what it received into fp32 and adds it up in fp32; ``AVG``
then divides by the number of ranks. Wire bytes per element of the gradient: 1 + 4 / B (int8),
0.5 + 4 / B (int4), against 4 for an fp32 reduce-scatter's input (ring: (S - 1) / S of it on
each link, the same share as the all-to-all's).

Hierarchical form (``ranks_per_node`` k > 1): step one exchanges within each node, so that the
rank with local index p holds its node's sum of the chunks of every rank with local index p;
step two exchanges those sums, quantized again, among the ranks of local index p across nodes.
Only step two crosses the network, and it carries 1/k of the chunks: ZeRO++'s cut of
cross-node traffic. The groups are made once, when the variant is attached, on every rank.

The transform (the exact oracle's): flat, rank j's result is the fp32 sum over the S ranks of
``blocks.roundtrip`` of rank r's chunk j, per parameter; hierarchical, the same within each
node, then the sum over nodes of the round trip of each node's sum.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import blocks
from .segments import Layout
from .wire import WireCollective


def is_average(op) -> bool:
    """Whether ``op`` asks for the mean (``ReduceOp.AVG``) rather than the sum."""
    if op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        return op == dist.ReduceOp.AVG
    raise ValueError(
        f"twinshard.variants: a quantized reduce-scatter takes ReduceOp.SUM or AVG, got {op}; "
        "a pre-multiplied sum (set_gradient_divide_factor) is not supported"
    )


class QuantizedReduceScatter(WireCollective):
    """torch's ``ReduceScatter`` interface (``FSDPModule.set_custom_reduce_scatter``): qgZ for
    one ``fully_shard``-ed module. ``groups``: ``node_groups(ranks_per_node)`` for the
    hierarchical form, None for the flat one."""

    def __init__(self, layout: Layout, bits: int = 8, block: int = 256, groups=None):
        blocks.max_code(bits)
        self.layout, self.bits, self.block, self.groups = layout, bits, block, groups
        super().__init__()

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        average = is_average(op)
        ranks = dist.get_world_size(group)
        chunks = input_tensor.reshape(ranks, -1)  # (S, n): row r goes to rank r
        segments = self.layout.split(chunks.shape[1], ranks, grads=True)
        if self.groups is None or not self.groups.hierarchical(group):
            total = self.exchange(chunks, segments, group)
        else:
            within, across = self.groups.of(group)
            k = dist.get_world_size(within)
            # row r = node * k + p; rank with local index p takes every node's row p
            by_local = chunks.view(ranks // k, k, -1).transpose(0, 1)  # (k, nodes, n), a view
            node_sum = self.exchange(by_local, segments, within)  # (nodes, n)
            total = self.exchange(node_sum, segments, across)
        if average:
            total /= ranks
        output_tensor.copy_(total.view(output_tensor.shape))
        return None

    def exchange(self, rows: torch.Tensor, segments: list[int], group) -> torch.Tensor:
        """Row r of ``rows`` (R, ..., n) quantized to rank r of ``group`` (R ranks), each of
        its n-value rows cut into ``segments``; what each sent this rank, dequantized and added
        up in fp32 (..., n)."""
        sent = blocks.pack(rows, segments, self.bits, self.block)  # (R, ..., m) uint8
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=group)
        self.sent_bytes += sent[0].numel() * (rows.shape[0] - 1)
        values = blocks.unpack(received, segments, self.bits, self.block, torch.float32)
        return values.sum(dim=0)  # (..., n)
