"""Block quantization: the numeric transform every quantized variant applies.

A flat tensor of ``n`` values is cut into blocks of ``block`` values (the last one padded with
zeros); each block is sent as signed integer codes of ``bits`` bits and one fp32 scale, the
block's largest magnitude over the largest code (127 for int8, 7 for int4), so that the largest
value of every block is sent exactly and the others to within half a step of the block's grid.
A block whose scale is below fp32's smallest normal number (its largest magnitude under about
1.5e-36) is sent as zeros. int4 codes are packed two to a byte (low nibble first, offset by 8).
Per element on the wire:

| bits | codes | scales (fp32, per block of ``B``) | bytes per element |
|---:|---:|---:|---:|
| 8 | 1 byte | 4 / B | 1 + 4 / B |
| 4 | 1/2 byte | 4 / B | 0.5 + 4 / B |

A message is several *segments* (one per parameter, [Note: blocks never cross a parameter] in
``segments.py``) quantized one after the other, each starting a new block, and packed as one
``uint8`` buffer: every segment's scales, then every segment's codes.

Each pass over the values costs a read and a write of the whole message, and at scale these
passes are what a quantized collective adds to the step (the plan prices them), so the int8
path makes as few as eager PyTorch allows: no padded copy when a segment fills its blocks,
the block's extremes in one pass (``aminmax``), codes rounded in place and converted straight
into the message, and on receipt each block multiplied by its scale straight into the
collective's output (``unpack(..., out=)``).
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # fp32
SMALLEST_SCALE = torch.finfo(torch.float32).tiny  # below it a scale's rounding is too coarse


def max_code(bits: int) -> int:
    """The largest code of a signed ``bits``-bit integer kept symmetric: 127 or 7."""
    if bits not in (4, 8):
        raise ValueError(f"twinshard.variants: bits must be 8 or 4, got {bits}")
    return 2 ** (bits - 1) - 1


def blocks_of(n: int, block: int) -> int:
    """How many blocks hold ``n`` values."""
    return -(-n // block)


def packed_bytes(segments: list[int], bits: int, block: int) -> int:
    """The bytes of a message of ``segments`` (numels): codes plus one fp32 scale per block."""
    codes = sum(blocks_of(n, block) * block * bits // 8 for n in segments)
    return codes + SCALE_BYTES * sum(blocks_of(n, block) for n in segments)


def grid_of(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` (..., n) as blocks (..., m, block): a view where the blocks fill ``n``, else a copy
    padded with zeros."""
    *lead, n = x.shape
    m = blocks_of(n, block)
    if n == m * block and x.stride(-1) == 1:
        return x.view(*lead, m, block)
    padded = x.new_zeros((*lead, m * block))
    padded[..., :n] = x
    return padded.view(*lead, m, block)


def rounded(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (..., n) as its codes, still in fp32 (..., m * block), and its scales (..., m).

    The division cannot leave the code range: a scale of a normal fp32 number is within half a
    unit in the last place of the block's largest magnitude over ``max_code``, so no value's
    quotient reaches ``max_code + 0.5``."""
    top = max_code(bits)
    grid = grid_of(x, block)  # (..., m, block)
    low, high = torch.aminmax(grid, dim=-1)  # (..., m) each
    scales = torch.maximum(high, -low).to(torch.float32) / top  # (..., m)
    safe = torch.where(scales >= SMALLEST_SCALE, scales, torch.ones_like(scales))
    codes = grid / safe[..., None]  # (..., m, block) fp32
    codes.round_()
    return codes.view(*x.shape[:-1], -1), scales


def nibbles(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes (..., 2k), any integer or integral float dtype, packed two a byte (..., k)."""
    pairs = (codes.to(torch.int16) + 8).view(*codes.shape[:-1], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)


def quantize(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (..., n) as codes (int8 (..., m * block), or uint8 (..., m * block / 2) for int4)
    and fp32 scales (..., m), m = ceil(n / block): each row of ``x`` on its own."""
    codes, scales = rounded(x, bits, block)
    return (codes.to(torch.int8) if bits == 8 else nibbles(codes)), scales


def dequantize_into(codes: torch.Tensor, scales: torch.Tensor, bits: int, block: int, out):
    """Write into ``out`` (..., n), in its dtype, the values that ``codes`` and ``scales``
    (``quantize``'s) stand for: each code times its block's scale, computed in fp32."""
    *lead, n = out.shape
    if bits == 4:
        low = (codes & 0xF).to(torch.int16) - 8
        high = (codes >> 4).to(torch.int16) - 8
        codes = torch.stack([low, high], dim=-1).view(*lead, -1)  # (..., m * block)
    full = n // block  # blocks that ``out`` holds whole: multiplied straight into it
    if full:
        whole = out[..., : full * block].view(*lead, full, block)
        codes_grid = codes[..., : full * block].view(*lead, full, block)
        torch.mul(codes_grid, scales[..., :full, None], out=whole)
    if n > full * block:  # the last, partial block: its padding is dropped
        tail = codes[..., full * block : (full + 1) * block].to(torch.float32)
        out[..., full * block :] = (tail * scales[..., full, None])[..., : n - full * block]
    return out


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, n: int, bits: int, block: int, dtype
) -> torch.Tensor:
    """The values (..., n) in ``dtype`` that ``quantize`` sent as ``codes`` and ``scales``."""
    out = torch.empty((*scales.shape[:-1], n), dtype=dtype, device=codes.device)
    return dequantize_into(codes, scales, bits, block, out)


def roundtrip(x: torch.Tensor, bits: int, block: int, dtype=None) -> torch.Tensor:
    """What the receiver of ``x`` (..., n) gets: quantized, then dequantized into ``dtype``
    (default: ``x``'s)."""
    codes, scales = quantize(x, bits, block)
    return dequantize(codes, scales, x.shape[-1], bits, block, dtype or x.dtype)


def pack(x: torch.Tensor, segments: list[int], bits: int, block: int) -> torch.Tensor:
    """``x`` (..., sum(segments)) as uint8 messages (..., ``packed_bytes``), one per row: each
    segment quantized on its own, scales first, then codes."""
    lead = x.shape[:-1]
    counts = [blocks_of(n, block) for n in segments]
    code_bytes = [m * block * bits // 8 for m in counts]
    scale_bytes = SCALE_BYTES * sum(counts)
    message = torch.empty(
        (*lead, scale_bytes + sum(code_bytes)), dtype=torch.uint8, device=x.device
    )
    scales_at, codes_at = 0, scale_bytes
    for piece, size in zip(x.split(segments, dim=-1), code_bytes):
        codes, scales = rounded(piece, bits, block)
        target = message[..., codes_at : codes_at + size]
        if bits == 8:
            target.view(torch.int8).copy_(codes)  # the fp32 codes converted as they are written
        else:
            target.copy_(nibbles(codes))
        message[..., scales_at : scales_at + scales.shape[-1] * SCALE_BYTES] = scales.view(
            torch.uint8
        )
        scales_at, codes_at = scales_at + scales.shape[-1] * SCALE_BYTES, codes_at + size
    return message


def unpack(
    message: torch.Tensor, segments: list[int], bits: int, block: int, dtype, out=None
) -> torch.Tensor:
    """The values (..., sum(segments)) in ``dtype`` of messages (..., bytes) ``pack`` made,
    written into ``out`` where given (of that shape; its dtype wins)."""
    counts = [blocks_of(n, block) for n in segments]
    code_bytes = [m * block * bits // 8 for m in counts]
    if out is None:
        out = torch.empty((*message.shape[:-1], sum(segments)), dtype=dtype, device=message.device)
    scale_bytes = SCALE_BYTES * sum(counts)
    scales_all = message[..., :scale_bytes].contiguous().view(torch.float32)  # (..., blocks)
    codes_all = message[..., scale_bytes:].split(code_bytes, dim=-1)
    values = out.split(segments, dim=-1)
    for codes, scales, piece in zip(codes_all, scales_all.split(counts, dim=-1), values):
        dequantize_into(codes.view(torch.int8) if bits == 8 else codes, scales, bits, block, piece)
    return out
