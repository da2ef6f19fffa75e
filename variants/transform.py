"""What a run's variants do to the numbers, declared so that a plain model can do the same.

``Communication(variants)`` is what the conformance suite certifies (``conformance/lossy.py``):
``attach(model, mesh)`` puts the variants on a sharded model; ``gathered(full, ranks)`` is the
parameter every rank computes with, given the true one; ``gradient_sum(contributions, ranks)``
the sum over one shard group's ranks of their gradients (each full-size, in rank order), before
FSDP divides it; ``step`` the transform's relative rounding step (the floor of the error budget
the suite derives from it). A researcher's own variant passes the suite by giving the same four.
All three follow the code exactly: padded chunks per rank ([Note: blocks never cross a
parameter]), fp32 sums, qgZ by node in two steps.
"""

from __future__ import annotations

import torch

from . import blocks, fp8
from .attach import Variant, attach


def chunks(t: torch.Tensor, ranks: int) -> list[torch.Tensor]:
    """``t``'s rows padded with zeros to ``ranks`` equal chunks, each flattened: the shards
    FSDP cuts (dim 0)."""
    rows = -(-t.shape[0] // ranks) if t.dim() else 1
    flat = t.reshape(t.shape[0] if t.dim() else 1, -1)
    padded = torch.cat([flat, flat.new_zeros(rows * ranks - flat.shape[0], flat.shape[1])])
    return [c.reshape(-1) for c in padded.split(rows)]


def unchunk(pieces: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The inverse of ``chunks``: ``like``'s shape, the padding dropped."""
    rows = like.shape[0] if like.dim() else 1
    return torch.cat(pieces).view(-1, *like.shape[1:])[:rows].reshape(like.shape)


def fp32_sum(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The sum of ``pieces`` in fp32, as the variants add up what they receive."""
    return torch.stack(pieces).to(torch.float32).sum(dim=0)


class Communication:
    """The variants of one run (at most one per collective), as the suite sees them."""

    def __init__(self, variants: list[Variant], reshard_after_forward=None):
        self.variants = list(variants)
        self.reshard_after_forward = reshard_after_forward  # hpZ: ranks per node
        self.weights = next((v for v in variants if v.collective == "all_gather"), None)
        self.grads = next((v for v in variants if v.collective == "reduce_scatter"), None)
        self.hooks: dict = {}  # attach's objects, by module name, of the last model

    @property
    def name(self) -> str:
        parts = [v.describe() for v in self.variants]
        if self.reshard_after_forward not in (None, True, False):
            parts.append(f"hpZ, nodes of {self.reshard_after_forward}")
        return " + ".join(parts) or "exact"

    @property
    def step(self) -> float:
        """The coarsest relative rounding of any variant: 1 / 127 (int8), 1 / 7 (int4), 2^-8
        (bf16's 8 significant bits), 2^-3 (e4m3's 3 stored bits)."""
        quantized = [v for v in self.variants if v.kind in ("qwz", "qgz")]
        steps = [1 / blocks.max_code(v.bits) for v in quantized]
        steps += [2.0**-8 for v in self.variants if v.kind == "bf16-wire"]
        steps += [2.0**-3 for v in self.variants if v.kind == "fp8"]
        return max(steps, default=2.0**-23)

    def attach(self, model, mesh) -> dict:
        """Put the variants on ``model``; the objects are kept in ``hooks`` (the last model's)."""
        self.hooks = attach(model, self.variants, mesh)
        return self.hooks

    def gathered(self, full: torch.Tensor, ranks: int) -> torch.Tensor:
        v = self.weights
        if v is None or ranks == 1:
            return full
        if v.kind == "fp8":  # whole parameters and whole rows: no rank boundary enters it
            return fp8.roundtrip(full, v.rows)
        pieces = [blocks.roundtrip(c, v.bits, v.block) for c in chunks(full, ranks)]
        return unchunk(pieces, full)

    def gradient_sum(self, contributions: list[torch.Tensor], ranks: int) -> torch.Tensor:
        v = self.grads
        if v is None or ranks == 1:
            return fp32_sum(contributions)
        if v.kind == "bf16-wire":
            trip = lambda c: c.to(torch.bfloat16).float()  # noqa: E731
        else:  # dequantized into fp32 whatever the gradients' dtype (a bf16 reduce_dtype's)
            trip = lambda c: blocks.roundtrip(c, v.bits, v.block, torch.float32)  # noqa: E731
        by_rank = [chunks(g, ranks) for g in contributions]  # [rank][chunk]
        k = v.ranks_per_node if v.kind == "qgz" and 1 < v.ranks_per_node < ranks else 1
        out = []
        for j in range(ranks):
            if k > 1:  # within each node, then the nodes' sums across nodes
                nodes = range(ranks // k)
                sums = [fp32_sum([trip(by_rank[m * k + p][j]) for p in range(k)]) for m in nodes]
                out.append(fp32_sum([trip(s) for s in sums]))
            else:
                out.append(fp32_sum([trip(r[j]) for r in by_rank]))
        return unchunk(out, contributions[0])
