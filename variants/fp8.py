"""fp8 weights: the weights' all-gather as float8 e4m3 codes, as torchao's float8 training
gathers a Linear's weight (``enable_fsdp_float8_all_gather``), here for every parameter of a
group and under every implementation.

A value x travels as the e4m3 code of x / s, clamped to e4m3's largest value (448), and is
received as code x s, computed in fp32 and rounded into the all-gather's dtype (the
mixed-precision ``param_dtype`` where there is one). The scale s is a largest magnitude over
448, in fp32 (a scale under fp32's smallest normal number is replaced by 1). Two scalings:

- **tensorwise** (``Variant("fp8")``, ``--variants fp8``): one scale per parameter, from the
  largest magnitude of the whole parameter. The ranks agree on it before they quantize, with
  one all-reduce (max) of 4 bytes per parameter over the shard group, as torchao's recipe does
  (``precompute_float8_dynamic_scale_for_fsdp``), once for each change of the parameters, so
  that a step's forward and backward share it (``Fp8AllGather.agreed``): every rank then
  knows every scale, and the all-gather carries the codes alone, 1 byte per element (0.5x a
  bf16 all-gather, 0.25x fp32). Every rank must change its parameters in place as often as
  the others (SPMD training does), or they would disagree on when to agree.
- **rowwise** (``Variant("fp8", rows=True)``, ``--variants fp8:rows``): each row of a matrix
  (its dim-0 slice, which FSDP never splits between ranks) at its own scale, sent after the
  codes in fp32; a vector (a bias, a norm's weight) tensorwise as above. 1 + 4 / C bytes per
  element for rows of C values.

The transform (what a plain model applies to be the exact oracle) is ``roundtrip`` of each
whole parameter: no padding or rank boundary enters it, since padding is zeros (the largest
magnitude does not move) and rows are whole on one rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .blocks import SCALE_BYTES, SMALLEST_SCALE
from .segments import Layout, padded_numel
from .wire import WireCollective, all_gather

E4M3 = torch.float8_e4m3fn
LARGEST = torch.finfo(E4M3).max  # 448


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """The fp32 scale of values whose largest magnitude is ``amax`` (any shape)."""
    scale = amax.to(torch.float32) / LARGEST
    return torch.where(scale >= SMALLEST_SCALE, scale, torch.ones_like(scale))


def encode(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``rows`` (..., C) as e4m3 codes in bytes (..., C), at ``scale`` (broadcast against it)."""
    codes = (rows.to(torch.float32) / scale).clamp_(-LARGEST, LARGEST)
    return codes.to(E4M3).view(torch.uint8)


def decode(codes: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    """The values in ``dtype`` that ``encode``'s bytes ``codes`` stand for at ``scale``."""
    return (codes.view(E4M3).to(torch.float32) * scale).to(dtype)


def as_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t``'s values as rows of ``width`` (0: the whole tensor one row)."""
    return t.reshape(-1, width) if width else t.reshape(1, -1)


def row_width(param_shape: torch.Size, rows: bool) -> int:
    """The values per scale of a parameter of ``param_shape`` under the rowwise scaling (a
    matrix's row), 0 for one scale over the whole parameter (tensorwise, or a vector)."""
    if not rows or len(param_shape) < 2 or param_shape[0] == 0:
        return 0
    return param_shape.numel() // param_shape[0]


def roundtrip(full: torch.Tensor, rows: bool, dtype=None) -> torch.Tensor:
    """What every rank computes with for the parameter ``full`` (in the all-gather's dtype):
    the declared transform, in ``dtype`` (default: ``full``'s)."""
    grid = as_rows(full, row_width(full.shape, rows))  # (rows, C)
    scale = scale_of(grid.abs().amax(dim=1, keepdim=True))  # (rows, 1)
    return decode(encode(grid, scale), scale, dtype or full.dtype).view(full.shape)


def packed_bytes(segments: list[int], widths: list[int]) -> int:
    """The bytes of one rank's message: a code per value, an fp32 scale per row of C values
    where ``widths`` gives C (0: tensorwise, its scale agreed rather than sent)."""
    scales = sum(n // w for n, w in zip(segments, widths) if w)
    return sum(segments) + SCALE_BYTES * scales


class Fp8AllGather(WireCollective):
    """torch's ``AllGather`` interface (``FSDPModule.set_custom_all_gather``): the weights
    as e4m3 codes for one ``fully_shard``-ed module, whose parameters ``layout`` names."""

    def __init__(self, layout: Layout, rows: bool = False):
        self.layout, self.rows = layout, rows
        super().__init__()
        self.gathered_bytes = 0
        self.cache = None  # (the parameters' version counters, what ``agreed`` returned)

    def params_of(self, input_tensor: torch.Tensor, ranks: int) -> list:
        """The parameters whose pieces a message holds: a group's (flat, torch's and the
        optimized path's) from the layout; one parameter's block (chunk, *rest), the
        reference's, the parameter of its size whose shard it is."""
        if input_tensor.dim() < 2:
            found = self.layout.params_of(input_tensor.numel(), ranks)
            if found is not None:
                return found
        sized = [p for p in self.layout.params if padded_numel(p, ranks) == input_tensor.numel()]
        if input_tensor.dim() >= 2:
            sized = [p for p in sized if p.shape[1:] == input_tensor.shape[1:]] or sized
        if len(sized) > 1:  # same size: told apart by their largest magnitude on this rank
            top = input_tensor.abs().amax()
            sized = [p for p in sized if _local(p).abs().amax().to(top.dtype) == top] or sized
        return sized[:1]

    def agreed(self, group) -> dict[int, torch.Tensor]:
        """id(parameter) -> the whole parameter's largest magnitude (fp32), agreed over the
        shard group once for each change of the group's parameters: while their version
        counters stand still (the optimizer's in-place update moves them alike on every rank),
        forward and backward share one all-reduce."""
        key = tuple(p._version for p in self.layout.params)  # the sharded parameters' own
        shards = [_local(p) for p in self.layout.params]
        if self.cache is None or self.cache[0] != key:
            zero = lambda t: t.new_zeros((), dtype=torch.float32)  # noqa: E731
            amax = [t.abs().amax().to(torch.float32) if t.numel() else zero(t) for t in shards]
            amax = torch.stack(amax)  # (parameters,)
            self.agree(amax, group)
            self.cache = key, dict(zip(map(id, self.layout.params), amax))
        return self.cache[1]

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        ranks = dist.get_world_size(group)
        if self.gathers_kept(self.layout, output_tensor, input_tensor, group):
            return None  # hpZ's backward gather: forward's values as they are
        shard = input_tensor.reshape(-1)  # (n,): this rank's padded shards, parameter by parameter
        segments = self.layout.split(shard.numel(), ranks)
        params = self.params_of(input_tensor, ranks)
        widths = [row_width(p.shape, self.rows) for p in params]
        pieces = [as_rows(p, w) for p, w in zip(shard.split(segments), widths)]
        agreed = self.agreed(group) if not all(widths) else {}
        scales = [  # a row's own largest magnitude; the parameter's, in the all-gather's dtype
            scale_of(piece.abs().amax(dim=1)) if w else scale_of(agreed[id(p)].to(shard.dtype))
            for piece, p, w in zip(pieces, params, widths)
        ]
        codes = [encode(p, s[:, None] if w else s) for p, s, w in zip(pieces, scales, widths)]
        sent = [s.view(torch.uint8) for s, w in zip(scales, widths) if w]  # the row scales
        message = torch.cat([c.reshape(-1) for c in codes] + sent)  # (m,) uint8
        gathered = torch.empty(ranks * message.numel(), dtype=torch.uint8, device=message.device)
        all_gather(gathered, message, group=group)
        self.sent_bytes += message.numel()
        self.gathered_bytes += gathered.numel()
        self.unpack(gathered.view(ranks, -1), segments, widths, scales, output_tensor)
        return None

    def agree(self, amax: torch.Tensor, group) -> None:
        """Make ``amax`` (one per parameter, this rank's shard's) the largest over the shard
        group, in place."""
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)

    def unpack(self, got, segments, widths, scales, output_tensor) -> None:
        """Every rank's codes (ranks, m) decoded into ``output_tensor`` (ranks x the shard)."""
        out = output_tensor.view(got.shape[0], -1)  # (ranks, n)
        at, scales_at = 0, sum(segments)
        for n, w, mine in zip(segments, widths, scales):
            if w:  # every rank's own row scales, after the codes
                size = n // w * SCALE_BYTES
                scale = got[:, scales_at : scales_at + size].contiguous().view(torch.float32)
                scale, scales_at = scale.view(-1, n // w, 1), scales_at + size
            else:
                scale = mine  # agreed: the same on every rank
            codes = got[:, at : at + n].reshape(got.shape[0], -1, w or n)
            out[:, at : at + n] = decode(codes, scale, out.dtype).view(-1, n)
            at += n


def _local(param) -> torch.Tensor:
    """This rank's shard of a sharded parameter (a DTensor's local tensor), or ``param``."""
    with torch.no_grad():
        return param.to_local() if hasattr(param, "to_local") else param
