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

import importlib

import pytest
import torch
import torch.nn as nn

from twinshard import switch
from twinshard.ranks.launch import launch
from twinshard.variants import attach, parse, sent_bytes

IMPLS = {"torch": "torch.distributed.fsdp", "reference": "twinshard.reference"}
IMPLS["optimized"] = "twinshard.optimized"
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
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = Model()
    if how == "switch":
        switch.use(impl, spec)
        from torch.distributed.fsdp import fully_shard  # looked up as a trainer does
    else:
        fully_shard = importlib.import_module(IMPLS[impl]).fully_shard
    try:
        for module in (*model.blocks, [model.norm, model.head], model):
            fully_shard(module, mesh=mesh)
        hooks = fully_shard.hooks if how == "switch" else attach(model, parse(spec), mesh)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(3):
            model(torch.randn(4, 6, generator=generator)).pow(2).sum().backward()
            optim.step()
            optim.zero_grad()
    finally:
        switch.restore()
    shards = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    return {"shards": shards, "sent": sent_bytes(hooks)}


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
