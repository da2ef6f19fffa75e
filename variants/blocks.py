"""Block quantization: the numeric transform every quantized variant applies.

A flat tensor of ``n`` values is cut into blocks of ``block`` values (the last one padded with
zeros); each block is sent as signed integer codes of ``bits`` bits and one fp32 scale, the
block's largest magnitude over the largest code (127 for int8, 7 for int4), so that the largest
value of every block is sent exactly and the others to within half a step of the block's grid.
int4 codes are packed two to a byte (low nibble first, offset by 8). Per element on the wire:

| bits | codes | scales (fp32, per block of ``B``) | bytes per element |
|---:|---:|---:|---:|
| 8 | 1 byte | 4 / B | 1 + 4 / B |
| 4 | 1/2 byte | 4 / B | 0.5 + 4 / B |

A message is several *segments* (one per parameter, [Note: blocks never cross a parameter] in
``segments.py``) quantized one after the other, each starting a new block, and packed as one
``uint8`` buffer: every segment's scales, then every segment's codes (scales first, so that they
start at a multiple of 4 bytes and read back as fp32 in place).
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # fp32


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


def quantize(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (..., n) as codes (int8 (..., m * block), or uint8 (..., m * block / 2) for int4)
    and fp32 scales (..., m), m = ceil(n / block): each row of ``x`` on its own."""
    top = max_code(bits)
    *lead, n = x.shape
    m = blocks_of(n, block)
    padded = torch.zeros((*lead, m * block), dtype=torch.float32, device=x.device)
    padded[..., :n] = x
    grid = padded.view(*lead, m, block)  # (..., m, block)
    scales = grid.abs().amax(dim=-1) / top  # (..., m)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(grid / safe[..., None]).clamp(-top, top).to(torch.int8)
    codes = codes.view(*lead, m * block)
    if bits == 4:  # two codes a byte, each offset into 1..15
        pairs = (codes.to(torch.int16) + 8).view(*lead, m * block // 2, 2)
        codes = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return codes, scales


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, n: int, bits: int, block: int, dtype
) -> torch.Tensor:
    """The values (..., n) in ``dtype`` that ``quantize`` sent as ``codes`` and ``scales``."""
    lead = scales.shape[:-1]
    if bits == 4:
        low = (codes & 0xF).to(torch.int16) - 8
        high = (codes >> 4).to(torch.int16) - 8
        codes = torch.stack([low, high], dim=-1)  # (..., m * block / 2, 2)
    grid = codes.to(torch.float32).reshape(*lead, -1, block) * scales[..., None]
    return grid.reshape(*lead, -1)[..., :n].to(dtype)


def roundtrip(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """What the receiver of ``x`` (..., n) gets: quantized, then dequantized into its dtype."""
    codes, scales = quantize(x, bits, block)
    return dequantize(codes, scales, x.shape[-1], bits, block, x.dtype)


def pack(x: torch.Tensor, segments: list[int], bits: int, block: int) -> torch.Tensor:
    """``x`` (..., sum(segments)) as uint8 messages (..., ``packed_bytes``), one per row: each
    segment quantized on its own, scales first, then codes."""
    parts = [quantize(piece, bits, block) for piece in x.split(segments, dim=-1)]
    scales = [s.view(torch.uint8) for _, s in parts]
    codes = [c.view(torch.uint8) for c, _ in parts]
    return torch.cat(scales + codes, dim=-1)


def unpack(
    message: torch.Tensor, segments: list[int], bits: int, block: int, dtype
) -> torch.Tensor:
    """The values (..., sum(segments)) in ``dtype`` of messages (..., bytes) ``pack`` made."""
    counts = [blocks_of(n, block) for n in segments]
    code_bytes = [m * block * bits // 8 for m in counts]
    scales_all, codes_all = message.split([SCALE_BYTES * sum(counts), sum(code_bytes)], dim=-1)
    scales = scales_all.contiguous().view(torch.float32).split(counts, dim=-1)
    codes = codes_all.split(code_bytes, dim=-1)
    out = []
    for n, c, s in zip(segments, codes, scales):
        c = c.view(torch.int8) if bits == 8 else c
        out.append(dequantize(c, s, n, bits, block, dtype))
    return torch.cat(out, dim=-1)
