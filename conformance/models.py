"""Small models and recipes that exercise one FSDP feature each, with uneven sizes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from twinshard.models import Llama, LlamaConfig, MLPStack

from .driver import Recipe


def batches(shape_fn, seed: int = 1234):
    """Global batch ``i``, the same on every rank: a generator seeded by ``seed + i``."""

    def data(i: int) -> tuple:
        g = torch.Generator().manual_seed(seed + i)
        return shape_fn(g)

    return data


GLOBAL_BATCH = 12  # divisible by every world size 1-4 (and 6): the data never depends on it


def mlp_data(dim: int = 15):
    return batches(
        lambda g: (
            torch.randn(GLOBAL_BATCH, dim, generator=g),
            torch.randn(GLOBAL_BATCH, dim, generator=g),
        )
    )


def mse(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    out = model(x)
    return (out.float() - y.float()).pow(2).mean()


def shard_blocks(impl, model: nn.Module, mesh, root: bool = True, **kwargs) -> None:
    """fully_shard each block, then the root (the usual wrap policy)."""
    for block in model.blocks:
        impl.fully_shard(block, mesh=mesh, **kwargs)
    if root:
        impl.fully_shard(model, mesh=mesh, **kwargs)


def mlp_recipe(world: int, wrap=None, **kwargs) -> Recipe:
    settings = dict(
        build=lambda: MLPStack(dim=15, hidden=37, n_blocks=3),
        wrap=wrap or shard_blocks,
        data=mlp_data(),
        loss=mse,
    )
    return Recipe(**{**settings, **kwargs})


def llama_config(tie: bool = False) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=37,
        dim=24,
        n_layers=2,
        n_heads=3,
        n_kv_heads=1,
        ffn_hidden=37,
        max_seq_len=16,
        tie_embeddings=tie,
        multiple_of=1,
    )


def llama_recipe(world: int, tie: bool = False, wrap=None, **kwargs) -> Recipe:
    def tokens(g):
        t = torch.randint(0, 37, (GLOBAL_BATCH, 10), generator=g)
        return t[:, :-1], t[:, 1:]

    return Recipe(
        build=lambda: Llama(llama_config(tie)),
        wrap=wrap or shard_blocks,
        data=batches(tokens),
        loss=lambda m, b: m(b[0], b[1]),
        lr=0.1,
        **kwargs,
    )


# --- models with a twist ---------------------------------------------------------------------
class TwiceMLP(MLPStack):
    """Runs block 0 twice in one forward: its gradient is the sum of two uses."""

    def forward(self, x):
        x = self.blocks[0](x)
        x = self.blocks[0](x)
        for block in self.blocks[1:]:
            x = block(x)
        return self.head(self.norm(x))


@dataclass
class Out:
    prediction: torch.Tensor
    note: str


class DictMLP(MLPStack):
    """Blocks return dicts and the root a dataclass: outputs need not be plain tensors."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        for block in self.blocks:
            block.forward = _dict_forward(block)

    def forward(self, x):
        for block in self.blocks:
            x = block({"x": x, "tag": 3})["x"]
        return Out(self.head(self.norm(x)), "ok")


def _dict_forward(block):
    plain = type(block).forward

    def forward(inputs):
        return {"x": plain(block, inputs["x"]), "tag": inputs["tag"]}

    return forward


class UnusedMLP(MLPStack):
    """Each block owns a layer that forward never calls: it gets no gradient."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        for block in self.blocks:
            block.unused = nn.Linear(7, 7)
        self.unused_root = nn.Linear(7, 3)


class SometimesMLP(MLPStack):
    """The first and every second forward after it skip the last block (control flow that
    changes between steps): an implementation that plans from the previous forward's order
    must cope. The skipped block still moves (SGD momentum with zeroed, not freed, gradients),
    so a gather prefetched for it and used a step later would hold stale weights."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        blocks = self.blocks[:-1] if self.calls % 2 else self.blocks
        for block in blocks:
            x = block(x)  # (..., dim)
        return self.head(self.norm(x))  # (..., out_dim)


class ScoreMLP(MLPStack):
    """Has a second entry point, ``score``, that FSDP must treat like forward."""

    def score(self, x, y):
        return (self.forward(x) - y).pow(2).mean()
