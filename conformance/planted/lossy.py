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

``CERTIFICATE`` holds one more per hole the certificate closes (``conformance/lossy_wire.py``,
``lossy_witness.py``), each a mistake that is easy to make and that the suite let through
before, with the claim it makes (variants, mixed precision, the mesh where it shows) and the
check that must catch it (``tests/variants/test_lossy_certificate.py``):

    partial_block_scale     qwZ dequantizes each parameter's last, partial block at 1.25x its
                            scale: a few values of a small tensor, tens of percent off
    scales_in_param_dtype   qwZ rounds the received scales to the all-gather's dtype: the
                            same bits in fp32, not in bf16
    int4_code_a_byte        int4 codes sent one a byte: the right numbers, twice the bytes
    averages_over_world     qgZ divides by the whole world, not its shard group: the same
                            in 1D, off by the replicas in HSDP
    own_chunk_exact         qgZ keeps its own chunk exact and quantizes the others'
    fp8_scale_not_agreed    fp8 tensorwise: each rank quantizes at its own shard's largest
                            magnitude, not the whole parameter's agreed one
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from twinshard.variants import Communication, Variant, blocks, fsdp_modules
from twinshard.variants.fp8 import Fp8AllGather
from twinshard.variants.qgz import QuantizedReduceScatter, is_average
from twinshard.variants.qwz import QuantizedAllGather, all_gather
from twinshard.variants.segments import Layout


class WrongScale(QuantizedAllGather):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        super().__call__(output_tensor, input_tensor, group)
        output_tensor.mul_(127 / 128)


def partial_blocks(hook: QuantizedAllGather, output_tensor, group):
    """The last, partial block of each parameter's piece of every rank in an all-gather's
    output, as views."""
    ranks = dist.get_world_size(group)
    for piece in output_tensor.view(ranks, -1):
        start = 0
        for n in hook.layout.split(piece.numel(), ranks):
            if n % hook.block:
                yield piece[start + n - n % hook.block : start + n]
            start += n


class DropsPartialBlock(QuantizedAllGather):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        super().__call__(output_tensor, input_tensor, group)
        for tail in partial_blocks(self, output_tensor, group):
            tail.zero_()


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


class PartialBlockScale(QuantizedAllGather):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        super().__call__(output_tensor, input_tensor, group)
        for tail in partial_blocks(self, output_tensor, group):
            tail.mul_(1.25)


class ScalesInParamDtype(QuantizedAllGather):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        ranks = dist.get_world_size(group)
        shard = input_tensor.reshape(-1)
        segments = self.layout.split(shard.numel(), ranks)
        message = blocks.pack(shard, segments, self.bits, self.block)
        gathered = torch.empty(ranks * message.numel(), dtype=torch.uint8)
        all_gather(gathered, message, group=group)
        self.sent_bytes += message.numel()
        self.gathered_bytes += gathered.numel()  # its own count, right: the wire says otherwise
        counts = [blocks.blocks_of(n, self.block) for n in segments]
        at = blocks.SCALE_BYTES * sum(counts)
        rows = gathered.view(ranks, -1)
        scales = rows[:, :at].contiguous().view(torch.float32).to(output_tensor.dtype).float()
        codes = rows[:, at:].view(torch.int8).split([m * self.block for m in counts], dim=-1)
        out = output_tensor.view(ranks, -1).split(segments, dim=-1)
        for c, sc, piece in zip(codes, scales.split(counts, dim=-1), out):
            blocks.dequantize_into(c, sc, self.bits, self.block, piece)


class Int4CodeAByte(QuantizedAllGather):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        ranks = dist.get_world_size(group)
        shard = input_tensor.reshape(-1)
        segments = self.layout.split(shard.numel(), ranks)
        pieces = [blocks.rounded(x, 4, self.block) for x in shard.split(segments)]
        scales = torch.cat([sc for _, sc in pieces]).view(torch.uint8)
        message = torch.cat([scales, *(c.to(torch.int8).view(torch.uint8) for c, _ in pieces)])
        gathered = torch.empty(ranks * message.numel(), dtype=torch.uint8)
        all_gather(gathered, message, group=group)
        self.sent_bytes += message.numel()
        self.gathered_bytes += gathered.numel()  # its own count, right: the wire says otherwise
        rows, at = gathered.view(ranks, -1), scales.numel()
        counts = [blocks.blocks_of(n, self.block) for n in segments]
        all_scales = rows[:, :at].contiguous().view(torch.float32).split(counts, dim=-1)
        codes = rows[:, at:].view(torch.int8).split([m * self.block for m in counts], dim=-1)
        out = output_tensor.view(ranks, -1).split(segments, dim=-1)
        for c, sc, piece in zip(codes, all_scales, out):
            blocks.dequantize_into(c, sc, 8, self.block, piece)


class AveragesOverWorld(QuantizedReduceScatter):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        super().__call__(output_tensor, input_tensor, group, dist.ReduceOp.SUM)
        if is_average(op):
            output_tensor.div_(dist.get_world_size())


class OwnChunkExact(QuantizedReduceScatter):
    def exchange(self, rows, segments, group):
        total = super().exchange(rows, segments, group)
        me = rows[dist.get_rank(group)]
        sent = blocks.unpack(blocks.pack(me, segments, self.bits, self.block), segments,
                             self.bits, self.block, torch.float32)  # fmt: skip
        return total - sent + me.float()


class Fp8ScaleNotAgreed(Fp8AllGather):
    def __init__(self, layout, bits, block):
        super().__init__(layout)

    def agree(self, amax, group):
        pass  # each rank quantizes at its own shard's scale


class PlantedCommunication(Communication):
    """The variants a planted class claims to be, declared as they are, with the planted
    class in place of the correct one of its kind on every group."""

    def __init__(self, planted, variants: list[Variant]):
        super().__init__(variants)
        self.planted = planted

    def attach(self, model, mesh) -> dict:
        hooks = super().attach(model, mesh)
        kind = (
            "reduce_scatter" if issubclass(self.planted, QuantizedReduceScatter) else "all_gather"
        )
        claimed = self.grads if kind == "reduce_scatter" else self.weights
        for name, group in fsdp_modules(model):
            hook = self.planted(Layout(group, name), claimed.bits, claimed.block)
            module = group[0] if isinstance(group, list) else group
            getattr(module, f"set_custom_{kind}")(hook)
            hooks[name][kind] = hook
        return hooks


# name -> (the class, the variants it claims to be, its param_dtype, the mesh where its mistake
# shows, the words of the failure that must catch it)
CERTIFICATE = {
    "partial_block_scale": (PartialBlockScale, [Variant("qwz", 8, 8)], None, (2,), "as gathered"),
    "scales_in_param_dtype": (
        ScalesInParamDtype, [Variant("qwz", 8, 8)], torch.bfloat16, (2,), "as gathered"
    ),
    "int4_code_a_byte": (Int4CodeAByte, [Variant("qwz", 4, 8)], None, (2,), "packed all-gathers"),
    "averages_over_world": (
        AveragesOverWorld, [Variant("qgz", 8, 8)], None, (2, 2), "declared sum"
    ),
    "own_chunk_exact": (OwnChunkExact, [Variant("qgz", 8, 8)], None, (2,), "declared sum"),
    "fp8_scale_not_agreed": (Fp8ScaleNotAgreed, [Variant("fp8")], None, (2,), "as gathered"),
}  # fmt: skip
