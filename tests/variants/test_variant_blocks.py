"""The block quantization's fast paths (``variants/blocks.py``): what they skip must not change
what a block means. Codes stay in range at every magnitude without a clamp, a message is read
from a strided view as from its copy, and the receiver writes straight into the output it is
given, in that output's dtype."""

from __future__ import annotations

import torch

from twinshard.variants import blocks


def test_codes_stay_in_range_at_every_magnitude():
    """One block of 64 values at each power of ten from 1e-45 to 1e38: no code leaves
    [-127, 127] (a code of 128 would wrap to -128 in int8), every block's largest value comes
    back exactly, and a block too small for a normal fp32 scale comes back as zeros."""
    torch.manual_seed(0)
    powers = torch.tensor([10.0**e for e in range(-45, 39)], dtype=torch.float64)
    x = (torch.rand(len(powers), 64, dtype=torch.float64) * 2 - 1) * powers[:, None]
    x = x.to(torch.float32)
    x[:, 0] = powers.to(torch.float32)  # each block's largest magnitude, positive
    codes, scales = blocks.quantize(x, 8, 64)
    assert codes.min().item() >= -127 and codes.max().item() <= 127
    back = blocks.dequantize(codes, scales, 64, 8, 64, torch.float32)
    normal = scales >= torch.finfo(torch.float32).tiny
    assert torch.equal(back[normal[:, 0], 0], x[normal[:, 0], 0])
    assert not back[~normal[:, 0]].any()  # 1e-45 .. 1e-36: zeros
    assert normal.sum().item() == 38 + 36  # 1e-35 .. 1e38
    step = scales[normal[:, 0]]
    assert ((back - x)[normal[:, 0]].abs() <= step / 2 * (1 + 1e-6)).all()


def test_a_strided_view_packs_as_its_copy():
    """qgZ's two steps pack the chunks of a (k, nodes, n) transposed view without copying it;
    the message must be the one its contiguous copy gives, for int8 and int4, with a segment
    that ends in a partial block."""
    chunks = torch.randn(4, 2, 300)  # (nodes, k, n)
    view = chunks.transpose(0, 1)  # (k, nodes, n), not contiguous
    for bits in (8, 4):
        message = blocks.pack(view, [200, 100], bits, 64)
        assert torch.equal(message, blocks.pack(view.contiguous(), [200, 100], bits, 64))
        assert message.shape == (2, 4, blocks.packed_bytes([200, 100], bits, 64))


def test_unpack_writes_into_the_output_it_is_given():
    """qwZ dequantizes straight into the all-gather's output: the values land in that tensor,
    in its dtype, equal to the fp32 values rounded once."""
    x = torch.randn(3, 530)
    message = blocks.pack(x, [512, 18], 8, 128)
    out = torch.full((3, 530), float("nan"), dtype=torch.bfloat16)
    returned = blocks.unpack(message, [512, 18], 8, 128, torch.bfloat16, out)
    assert returned.data_ptr() == out.data_ptr() and not out.isnan().any()
    fp32 = blocks.unpack(message, [512, 18], 8, 128, torch.float32)
    assert torch.equal(out, fp32.to(torch.bfloat16))
    assert (fp32 - x).abs().max().item() <= x.abs().max().item() / 127
