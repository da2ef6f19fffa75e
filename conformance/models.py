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


class Expert2Block(nn.Module):
    """Two experts; each row goes to the one its route flag names. An expert that no row of
    this batch goes to is not called at all, so on a rank whose rows all go to the other one
    its parameters get no gradient (routing in a mixture of experts)."""

    def __init__(self, dim: int = 15):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))

    def forward(self, h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)  # (B, dim)
        for flag, expert in enumerate(self.experts):
            rows = route == flag  # (B,)
            if rows.any():
                out = out.index_put((rows,), expert(h[rows]))
        return h + out


class RoutedMLP(nn.Module):
    """Blocks of two experts, then a head; the last input column is each row's route."""

    def __init__(self, dim: int = 15, n_blocks: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(Expert2Block(dim) for _ in range(n_blocks))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, route = x[:, :-1], x[:, -1].long()  # (B, dim), (B,)
        for block in self.blocks:
            h = block(h, route)
        return self.head(h)


def routed_recipe(world: int, wrap=None, **kwargs) -> Recipe:
    """Rank r's rows all take route r % 2: at world size >= 2 each expert is used on some
    ranks only, while the plain model on the global batch uses both."""
    per_rank = GLOBAL_BATCH // world

    def data(i: int) -> tuple:
        g = torch.Generator().manual_seed(4321 + i)
        x = torch.randn(GLOBAL_BATCH, 16, generator=g)  # (B, dim + 1)
        x[:, -1] = (torch.arange(GLOBAL_BATCH) // per_rank % 2).float()  # the route column
        return x, torch.randn(GLOBAL_BATCH, 15, generator=g)

    settings = dict(build=lambda: RoutedMLP(), wrap=wrap or shard_blocks, data=data, loss=mse)
    return Recipe(**{**settings, **kwargs})


class SequentialList(nn.ModuleList):
    """A ``ModuleList`` that defines ``forward``: it runs its modules in order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self:
            x = module(x)
        return x


class ListMLP(MLPStack):
    """``MLPStack`` whose blocks are called through a ``SequentialList``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.blocks = SequentialList(self.blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(x)))  # (..., dim)


class Float8ScaleMLP(MLPStack):
    """Each block scales its input by a frozen float8 vector, beside its float32 weights:
    a group whose parameters have two dtypes."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        for block in self.blocks:
            scale = (1 + 0.1 * torch.randn(15)).to(torch.float8_e4m3fn)
            block.scale = nn.Parameter(scale, requires_grad=False)
            block.register_forward_pre_hook(lambda m, args: (args[0] * m.scale.float(),))
