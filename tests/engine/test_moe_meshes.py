"""Per-parameter meshes (issue 34, item 1): a mixture-of-experts model whose experts are
sharded over an expert-data-parallel mesh and whose router, shared expert and other layers are
sharded over the whole data-parallel mesh, in the same ``fully_shard`` calls, as torch 2.13's
``shard_placement_fn`` returning ``ShardPlacementResult`` does it (torchtitan's EP + FSDP).

Four gloo ranks. The mesh (ep=2, efsdp=2): ranks 0 and 1 hold one half of the experts, ranks 2
and 3 the other half (each pair its own values, as expert parallelism places them), and each
pair shards its half between its two ranks; the dense layers are sharded over all four. Top-2
routing over the rank's experts, uneven rows everywhere (3 experts over 2 ranks, 3 router rows
over 4). Under torch's ``fully_shard``, the reference and the optimized path:

- the sharded parameters and gradients have torch's meshes and placements (experts on the
  2-rank mesh); the optimized path's losses and shards are bitwise equal to torch's after
  three AdamW steps and two SGD steps, the reference's equal to rounding (its per-parameter
  reduce-scatters over 4 gloo ranks sum in another order than one flat buffer's: 1.5e-8 at
  most here);
- checkpoints interchange: a model of one implementation loads another's ``state_dict`` and
  goes on to the same numbers as the one that saved it;
- ``reshard_after_forward=2`` (rows of 2 on the 4-rank mesh; the experts' mesh has 2 ranks, so
  they reshard fully, as torch's per-mesh group does) gives the same numbers;
- a ``mesh_info`` that is neither 1D FSDP nor 2D HSDP is refused, naming the parameter.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn as nn

from twinshard.ranks.launch import launch

TORCH = "torch.distributed.fsdp"
IMPLS = (TORCH, "twinshard.reference", "twinshard.optimized")
TWINSHARD = IMPLS[1:]
D, H, EXPERTS, TOP_K = 8, 6, 3, 2  # model width, expert width, experts per rank, routing


class Experts(nn.Module):
    """This rank's experts, stacked: expert e maps x to relu(x @ w1[e]) @ w2[e]."""

    def __init__(self, generator: torch.Generator):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, D, H, generator=generator) * 0.3)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, H, D, generator=generator) * 0.3)

    def forward(self, x, chosen, weight):  # x (T, D), chosen and weight (T, K)
        hidden = torch.einsum("td,tkdh->tkh", x, self.w1[chosen]).relu()  # (T, K, H)
        return torch.einsum("tkh,tkhd,tk->td", hidden, self.w2[chosen], weight)  # (T, D)


class MoEBlock(nn.Module):
    def __init__(self, generator: torch.Generator):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.router = nn.Linear(D, EXPERTS, bias=False)
        self.experts = Experts(generator)
        self.shared = nn.Linear(D, D)  # the shared expert: dense, on every rank

    def forward(self, x):
        h = self.norm(x)
        weight, chosen = self.router(h).softmax(-1).topk(TOP_K, dim=-1)  # (T, K) each
        return x + self.experts(h, chosen, weight) + self.shared(h)


class MoEModel(nn.Module):
    def __init__(self, ep_rank: int):
        super().__init__()
        torch.manual_seed(0)  # the dense layers: the same on every rank
        experts = torch.Generator().manual_seed(100 + ep_rank)  # each expert half its own
        self.embed = nn.Linear(D, D)
        self.blocks = nn.ModuleList(MoEBlock(experts) for _ in range(2))
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _placed(t) -> tuple:
    return str(t.placements), tuple(t.device_mesh.mesh.flatten().tolist())


def _build(impl, meshes, reshard_after_forward=None):
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        ShardPlacementResult,
    )
    from torch.distributed.tensor import Shard

    world, experts_mesh = meshes
    model = MoEModel(ep_rank=torch.distributed.get_rank() // 2)
    info = FSDPMeshInfo(mesh=experts_mesh, shard_mesh_dim=0)  # one object for all experts
    experts = {p for block in model.blocks for p in block.experts.parameters()}

    def placement(p):
        return ShardPlacementResult(placement=Shard(0), mesh_info=info) if p in experts else None

    for block in model.blocks:
        impl.fully_shard(
            block,
            mesh=world,
            shard_placement_fn=placement,
            reshard_after_forward=reshard_after_forward,
        )
    impl.fully_shard(model, mesh=world)
    return model


def _steps(model, optim, n: int, first: int) -> list[float]:
    losses = []
    for step in range(first, first + n):
        rank = torch.distributed.get_rank()
        x = torch.randn(5, D, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _local(model) -> dict:
    return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}


def _train(impl, meshes, reshard_after_forward=None) -> dict:
    model = _build(impl, meshes, reshard_after_forward)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    out = {"sharded": {n: _placed(p) for n, p in model.named_parameters()}}
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(99))
    model(x).sum().backward()
    out["grad"] = {n: _placed(p.grad) for n, p in model.named_parameters()}
    optim.zero_grad()
    out["losses"] = _steps(model, optim, 3, first=0)
    out["local"] = _local(model)
    out["saved"] = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    out["then"] = _steps(model, torch.optim.SGD(model.parameters(), lr=0.1), 2, first=3)
    out["then_local"] = _local(model)
    return out


def _loaded(impl, meshes, saved_by) -> dict:
    """A fresh model of ``impl`` loads the state dict another implementation saved (its local
    shards, put into this model's DTensors) and trains the steps the saver went on with."""
    model = _build(impl, meshes)
    state = model.state_dict()
    for key, local in saved_by.items():
        state[key].to_local().copy_(local)
    model.load_state_dict(state)
    losses = _steps(model, torch.optim.SGD(model.parameters(), lr=0.1), 2, first=3)
    return {"then": losses, "then_local": _local(model)}


def _bad_mesh_info(impl, meshes) -> str | None:
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        ShardPlacementResult,
    )

    world, _ = meshes
    from torch.distributed.device_mesh import init_device_mesh

    two_d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    info = FSDPMeshInfo(mesh=two_d, shard_mesh_dim=1)  # sharded over b, a left unsaid
    model = MoEModel(0)
    try:
        impl.fully_shard(
            model.blocks[0],
            mesh=world,
            shard_placement_fn=lambda p: ShardPlacementResult(None, info) if p.dim() == 3 else None,
        )
    except Exception as error:  # noqa: BLE001 - the message is what is checked
        return f"{type(error).__name__}: {error}"
    return None


def _run() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    world = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    experts_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "efsdp"))["efsdp"]
    meshes = (world, experts_mesh)
    out = {}
    for name in IMPLS:
        impl = importlib.import_module(name)
        out[name, "train"] = _train(impl, meshes)
        out[name, "rows"] = _train(impl, meshes, reshard_after_forward=2)
    for name in IMPLS:
        for saver in IMPLS:
            if saver != name:
                saved = out[saver, "train"]["saved"]
                out[name, "loads", saver] = _loaded(importlib.import_module(name), meshes, saved)
    for name in TWINSHARD:
        out[name, "bad"] = _bad_mesh_info(importlib.import_module(name), meshes)
    return out


_results: list = []


def results() -> list[dict]:
    """Every rank's outcomes, from one launch of four gloo ranks shared by the tests."""
    if not _results:
        _results.extend(launch(_run, 4))
    return _results


def _same(mine: dict, theirs: dict, exact: bool = True) -> None:
    assert set(mine) == set(theirs)
    for key, value in theirs.items():
        if exact:
            assert torch.equal(mine[key], value), key
        else:
            torch.testing.assert_close(mine[key], value, rtol=1e-6, atol=1e-7, msg=key)


@pytest.mark.parametrize("name", TWINSHARD)
@pytest.mark.parametrize("case", ("train", "rows"))
def test_experts_on_their_own_mesh_train_as_torch(name, case):
    for rank, out in enumerate(results()):
        mine, theirs = out[name, case], out[TORCH, case]
        assert mine["sharded"] == theirs["sharded"], rank
        assert mine["grad"] == theirs["grad"], rank
        experts = [n for n in theirs["sharded"] if ".experts." in n]
        assert len(experts) == 4 and all(
            theirs["sharded"][n][1] == ((0, 1) if rank < 2 else (2, 3)) for n in experts
        ), theirs["sharded"]  # the control: torch puts the experts on the 2-rank mesh
        assert theirs["sharded"]["head.weight"][1] == (0, 1, 2, 3)
        exact = name == "twinshard.optimized"  # one flat reduce-scatter per mesh, as torch's
        losses = mine["losses"] + mine["then"], theirs["losses"] + theirs["then"]
        assert losses[0] == losses[1] if exact else losses[0] == pytest.approx(losses[1], 1e-6)
        _same(mine["local"], theirs["local"], exact)
        _same(mine["then_local"], theirs["then_local"], exact)


def test_expert_halves_differ_and_training_moves_them():
    """The controls: the two expert halves hold different values, so a collective over the
    wrong ranks would mix them, and the steps change every parameter."""
    out = results()
    w1 = [o[TORCH, "train"]["local"]["blocks.0.experts.w1"] for o in out]
    assert torch.equal(w1[0], w1[0]) and not torch.equal(w1[0], w1[2])
    first = out[0][TORCH, "train"]
    assert first["losses"][0] != first["losses"][-1]


@pytest.mark.parametrize("name", IMPLS)
def test_checkpoints_interchange(name):
    for out in results():
        for saver in IMPLS:
            if saver == name:
                continue
            loaded, went_on = out[name, "loads", saver], out[saver, "train"]
            exact = "twinshard.reference" not in (name, saver)  # see the module docstring
            then = (loaded["then"], went_on["then"])
            assert then[0] == then[1] if exact else then[0] == pytest.approx(then[1], 1e-6)
            _same(loaded["then_local"], went_on["then_local"], exact)


@pytest.mark.parametrize("name", TWINSHARD)
def test_a_mesh_info_that_is_neither_fsdp_nor_hsdp_is_refused(name):
    for out in results():
        message = out[name, "bad"]
        assert message is not None and message.startswith("FSDPUsageError"), message
        assert "blocks.0.experts" in message or "'w1'" in message, message
        assert "shard_mesh_dim=1" in message and "FSDPMeshInfo(mesh, shard_mesh_dim=0)" in message
