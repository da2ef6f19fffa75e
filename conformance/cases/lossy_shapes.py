"""The shapes ZeRO++ users reported failures on, as lossy cases under every variant.

DeepSpeed's tracker has qwZ crashing on some parameter shapes, hpZ giving zero or NaN losses,
a loss stuck with a gradient norm of 0, and a padding assertion on sizes not divisible by 8.
``Awkward`` holds each such shape in one small model, and each case trains it under one set of
variants, judged as every lossy case is (``conformance/lossy.py``: the collectives' results,
the wire, the exact oracle and the budget):

- sizes divisible neither by 8 nor by any block (13, 29), odd shards at 3 ranks, and at the
  default block of 256 pieces smaller than one block;
- a frozen linear in every block (its parameters in the group's all-gather, not in its
  reduce-scatter), a parameter used twice (the embedding's weight read again at the root: a
  tie), a linear of all zeros (a block whose scale is 0), and a parameter of magnitude 1e30
  (scaled down where it is used; its gradients of about 1e-31 test the smallest scales);
- hpZ with ``reshard_after_forward=2`` at a shard group of 4 in nodes of 2.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from twinshard.variants import Communication, Variant

from .. import models as M
from .core import case
from .lossy import WHY, judge, needs_nodes, sharded

IN, WIDTH = 13, 29


class AwkwardBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.zero = nn.Linear(WIDTH, WIDTH)
        nn.init.zeros_(self.zero.weight)
        nn.init.zeros_(self.zero.bias)
        self.huge = nn.Parameter(torch.randn(WIDTH) * 1e30)
        self.w = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (B, WIDTH) -> (B, WIDTH)
        h = h + torch.tanh(self.frozen(h)) + self.zero(h) + self.huge * 1e-30
        return h + torch.relu(self.w(h))


class Awkward(nn.Module):
    """``embed`` -> two ``AwkwardBlock``s -> ``out``, plus the embedding's weight read again."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(IN, WIDTH)
        self.blocks = nn.ModuleList([AwkwardBlock(), AwkwardBlock()])
        self.out = nn.Linear(WIDTH, IN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, IN) -> (B, IN)
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h) + h @ self.embed.weight  # (B, WIDTH) @ (WIDTH, IN): the tie


def _judge(ctx, variants: list[Variant], hpz: int | None = None):
    model = dict(build=Awkward, data=M.mlp_data(IN))
    return judge(ctx, Communication(variants, hpz), model)


@case("lossy", needs=sharded, why=WHY)
def case_lossy_shapes_int8(ctx):
    """qwZ and qgZ in int8, blocks of 8, on the awkward shapes."""
    return _judge(ctx, [Variant("qwz", 8, 8), Variant("qgz", 8, 8)])


@case("lossy", needs=sharded, why=WHY)
def case_lossy_shapes_int4(ctx):
    """qwZ and qgZ in int4, blocks of 8, on the awkward shapes."""
    return _judge(ctx, [Variant("qwz", 4, 8), Variant("qgz", 4, 8)])


@case("lossy", needs=sharded, why=WHY)
def case_lossy_shapes_default_block(ctx):
    """qwZ and qgZ in int8 at the default block, larger than every piece."""
    return _judge(ctx, [Variant("qwz"), Variant("qgz")])


@case("lossy", needs=sharded, why=WHY)
def case_lossy_shapes_bf16_wire(ctx):
    """qwZ in int8 and the gradients on a bf16 wire, on the awkward shapes."""
    return _judge(ctx, [Variant("qwz", 8, 8), Variant("bf16-wire")])


@case("lossy", needs=needs_nodes, why="needs a shard group of at least 4 ranks, in nodes of 2")
def case_lossy_shapes_hpz(ctx):
    """ZeRO++ whole on the awkward shapes: qwZ, qgZ by node and hpZ (nodes of 2)."""
    variants = [Variant("qwz", 8, 8), Variant("qgz", 8, 8, ranks_per_node=2)]
    return _judge(ctx, variants, hpz=2)
