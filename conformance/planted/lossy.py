"""Communication variants with a planted lossy bug, for checking that the variants' oracle
(``tests/variants/test_variants.py``: the plain model with the variant's declared transform) catches each.

Each is a subclass of a correct variant from ``twinshard.variants`` that keeps its declared
transform and breaks what it does on the wire:

    wrong_scale           qwZ dequantizes with 127/128 of each block's scale
    drops_partial_block   qwZ's receiver zeroes the last, partial block of every parameter
    blocks_shift_by_rank  qwZ: rank r starts its blocks r values into each parameter (the
                          receivers know: a self-consistent code, but not the declared one)
    int8_sends_bf16       the "int8" all-gather sends the shard in bf16 and casts it back
    sums_without_dividing qgZ adds the ranks' chunks and ignores ReduceOp.AVG
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from twinshard.variants import blocks
from twinshard.variants.qgz import QuantizedReduceScatter
from twinshard.variants.qwz import QuantizedAllGather, all_gather


class WrongScale(QuantizedAllGather):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        super().__call__(output_tensor, input_tensor, group)
        output_tensor.mul_(127 / 128)


class DropsPartialBlock(QuantizedAllGather):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        super().__call__(output_tensor, input_tensor, group)
        ranks = dist.get_world_size(group)
        for piece in output_tensor.view(ranks, -1):
            start = 0
            for n in self.layout.split(piece.numel(), ranks):
                tail = n % self.block
                if tail:
                    piece[start + n - tail : start + n] = 0
                start += n


class BlocksShiftByRank(QuantizedAllGather):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        ranks, me = dist.get_world_size(group), dist.get_rank(group)
        shard = input_tensor.reshape(-1)
        segments = self.layout.split(shard.numel(), ranks)

        def shifted(r):  # rank r's segments, each split r values in
            return [part for n in segments for part in (min(r, n), n - min(r, n)) if part]

        message = blocks.pack(shard, shifted(me), self.bits, self.block)
        sizes = [blocks.packed_bytes(shifted(r), self.bits, self.block) for r in range(ranks)]
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[: message.numel()] = message
        gathered = torch.empty(ranks * padded.numel(), dtype=torch.uint8)
        all_gather(gathered, padded, group=group)
        out = output_tensor.view(ranks, -1)
        for r, piece in enumerate(gathered.view(ranks, -1)):
            values = blocks.unpack(piece[: sizes[r]], shifted(r), self.bits, self.block, out.dtype)
            out[r].copy_(values)


class Int8SendsBf16(QuantizedAllGather):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        ranks = dist.get_world_size(group)
        low = input_tensor.reshape(-1).to(torch.bfloat16)
        gathered = torch.empty(ranks * low.numel(), dtype=torch.bfloat16)
        all_gather(gathered, low, group=group)
        output_tensor.view(-1).copy_(gathered)
        self.sent_bytes += blocks.packed_bytes(self.layout.split(low.numel(), ranks), 8, self.block)


class SumsWithoutDividing(QuantizedReduceScatter):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        super().__call__(output_tensor, input_tensor, group, dist.ReduceOp.SUM)


PLANTED = {
    "wrong_scale": WrongScale,
    "drops_partial_block": DropsPartialBlock,
    "blocks_shift_by_rank": BlocksShiftByRank,
    "int8_sends_bf16": Int8SendsBf16,
    "sums_without_dividing": SumsWithoutDividing,
}
