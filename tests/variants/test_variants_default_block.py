"""The three implementations give the same bits under every variant at the default block.

A quantized variant cuts each parameter's piece of a message into blocks (``segments.py``):
the blocks are the same under torch's ``fully_shard``, the reference and the optimized path
only if each finds its parameters where the others do. With blocks of 8 values (the suite's
cases) nearly every boundary falls on a block's edge whatever the order, so only the default
block of 256 shows a message laid out in another order. The model here has parameters at
several depths of one block and one of the block's own (torch's order, each module's own after
its children's, differs from a breadth-first walk and from ``module.parameters()``), pieces
smaller than a block and pieces that end inside one, and a list of
modules sharded as one group (``fully_shard([norm, head])``, as accelerate and the HF Trainer
shard the last layers). Each variant trains 3 steps at 2 ranks, its collectives set by hand
(``variants.attach``) and by the switch, under each implementation: every rank's shards must
be equal bit for bit across all six runs, and differ from the exact run's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from test_variants_switched import IMPLS
from test_variants_switched import _train as switched_train

from twinshard.ranks.launch import launch

SPECS = ("qwz", "qgz", "qwz+qgz", "qwz:bits=4+qgz:bits=4", "bf16-wire")


class Block(nn.Module):
    """A norm beside two deeper linears (breadth first meets the norm before the linears), and
    a parameter of the block's own, which torch's order puts after its children's."""

    def __init__(self, dim: int = 24):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(dim))
        self.attn = nn.Sequential(nn.Linear(dim, dim))  # 2 x 288-value pieces: 256 + 32
        self.norm = nn.LayerNorm(dim)  # 12-value pieces: smaller than a block
        self.mlp = nn.Sequential(nn.Linear(dim, 40), nn.ReLU(), nn.Linear(40, dim))

    def forward(self, x):
        x = x + self.attn(self.norm(x)) * self.gain
        return x + self.mlp(x)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 24)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(24)
        self.head = nn.Linear(24, 7)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _train(impl: str, spec: str, how: str) -> dict:
    """``Model`` sharded block by block, then the last layers as one list, then the root, and
    trained 3 steps (``test_variants_switched._train``'s ways)."""
    groups = lambda m: (*m.blocks, [m.norm, m.head], m)  # noqa: E731
    return switched_train(impl, spec, how, build=Model, groups=groups, steps=3)


def _all() -> dict:
    runs = {(impl, "", "by hand"): _train(impl, "", "by hand") for impl in IMPLS}
    for spec in SPECS:
        for impl in IMPLS:
            for how in ("by hand", "switch"):
                runs[impl, spec, how] = _train(impl, spec, how)
    return runs


@pytest.fixture(scope="module")
def two_ranks():
    return launch(_all, 2)


@pytest.mark.parametrize("spec", SPECS)
def test_every_implementation_sends_the_same_blocks(two_ranks, spec):
    for rank in two_ranks:
        first = rank["torch", spec, "by hand"]
        exact = rank["torch", "", "by hand"]["shards"]
        assert any(not torch.equal(s, exact[n]) for n, s in first["shards"].items()), spec
        for impl in IMPLS:
            for how in ("by hand", "switch"):
                run = rank[impl, spec, how]
                assert run["sent"] == first["sent"], (impl, how)
                unequal = [
                    n for n, s in first["shards"].items() if not torch.equal(run["shards"][n], s)
                ]
                assert not unequal, f"{spec}: {impl} ({how}) differs from torch in {unequal}"
