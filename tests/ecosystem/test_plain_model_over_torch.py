"""Where twinshard keeps the plain (unsharded) model's numbers and torch's ``fully_shard`` does
not (issue 31, item 4; docs/torch-tests.md, "Where twinshard's behaviour is the better one").

Each program runs under torch's ``fully_shard``, the reference and the optimized path, and on
the plain model with the same data (rank r's batch; the plain loss is the mean over ranks, as
FSDP's gradient is). The tests ask twinshard for the plain model's numbers and assert that
torch's differ, in the way torch 2.13's code says they must, so that a torch that changes is
noticed:

- **A parameter assigned after the first forward** (a tie, ``head.weight = embed.weight``, or a
  new ``DTensor`` parameter): twinshard adopts the module's parameter at every unshard; torch
  adopts a replaced parameter only at its lazy init (and after ``_apply`` or a state-dict load),
  so later it keeps gathering the parameter it sharded and puts that one back on the module.
- **A penalty on the parameters computed after the forward, with ``reshard_after_forward`` an
  int**: twinshard puts the sharded parameter back on the module after forward, and the
  penalty's gradient lands on it; torch puts a new ``Parameter`` holding the post-forward piece
  there, whose gradient is freed at the next unshard. Four ranks: with two, an int is 1 or 2,
  which torch reads as ``False`` or ``True``.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
import torch.nn as nn

from twinshard.ranks.launch import launch

TORCH = "torch.distributed.fsdp"
IMPLS = (TORCH, "twinshard.reference", "twinshard.optimized")
TWINSHARD = IMPLS[1:]
DIM = 7  # rows that do not divide over the ranks: padded shards too


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM), nn.Tanh(),
                         nn.Linear(DIM, DIM))  # fmt: skip


def _shard(impl, model: nn.Sequential, **kwargs) -> None:
    for layer in (model[0], model[2], model[4]):
        impl.fully_shard(layer, **kwargs)
    impl.fully_shard(model, **kwargs)


def _penalty(model: nn.Module) -> torch.Tensor:
    """The sum of every parameter's squares (weight decay written into the loss)."""
    total = sum(p.pow(2).sum() for p in model.parameters())
    return total.full_tensor() if hasattr(total, "full_tensor") else total


def _plain_loss(plain: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Every rank's batch, the loss averaged over ranks: FSDP's gradient is the ranks' mean."""
    return sum(plain(batch).pow(2).sum() for batch in x) / len(x)


def _steps(model, plain, first: int, steps: int, penalty: bool = False) -> None:
    """SGD with momentum, on the sharded model (this rank's batch) and the plain one."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    optims = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, plain)]
    for step in range(first, first + steps):
        x = torch.randn(world, 4, DIM, generator=torch.Generator().manual_seed(step))
        loss, plain_loss = model(x[rank]).pow(2).sum(), _plain_loss(plain, x)
        if penalty:  # computed after the forward, on whatever the module holds then
            loss, plain_loss = loss + _penalty(model), plain_loss + _penalty(plain)
        for value, optim in zip((loss, plain_loss), optims):
            value.backward()
            optim.step()
            optim.zero_grad()


def _full(model: nn.Module) -> dict:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}  # fmt: skip


def _assigned_after_forward(impl, kind: str) -> dict:
    """One step, then ``model[2].weight`` tied to ``model[0].weight`` or replaced by a new
    DTensor parameter (on the plain model too), then two more steps."""
    from torch.distributed.tensor import Shard, distribute_tensor

    model = _model()
    plain = copy.deepcopy(model)
    _shard(impl, model)
    _steps(model, plain, first=0, steps=1)
    if kind == "tie":
        assigned = model[2].weight = model[0].weight
        plain[2].weight = plain[0].weight
    else:
        new = torch.full((DIM, DIM), 0.05)
        mesh = model[2].weight.device_mesh
        assigned = model[2].weight = nn.Parameter(distribute_tensor(new, mesh, [Shard(0)]))
        plain[2].weight = nn.Parameter(new.clone())
    _steps(model, plain, first=1, steps=2)
    return {"params": _full(model), "plain": _full(plain), "kept": model[2].weight is assigned}


def _penalty_after_forward(impl) -> dict:
    """Three steps with ``reshard_after_forward=2`` on four ranks and a penalty on the
    parameters in the loss; the plain model trained with it, and without it."""
    model = _model()
    plain, dropped = copy.deepcopy(model), copy.deepcopy(model)
    _shard(impl, model, reshard_after_forward=2)
    _steps(model, plain, first=0, steps=3, penalty=True)
    optim = torch.optim.SGD(dropped.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):  # the same steps on the plain model, without the penalty
        world = torch.distributed.get_world_size()
        x = torch.randn(world, 4, DIM, generator=torch.Generator().manual_seed(step))
        _plain_loss(dropped, x).backward()
        optim.step()
        optim.zero_grad()
    return {"params": _full(model), "plain": _full(plain), "dropped": _full(dropped)}


def _run(checks: dict) -> dict:
    out = {}
    for check, (fn, *args) in checks.items():
        for name in IMPLS:
            try:
                out[check, name] = fn(importlib.import_module(name), *args)
            except Exception as error:  # noqa: BLE001 - reported by the test that reads it
                out[check, name] = {"crashed": f"{type(error).__name__}: {error}"}
    return out


def _run_2() -> dict:
    return _run({kind: (_assigned_after_forward, kind) for kind in ("tie", "new_dtensor")})


def _run_4() -> dict:
    return _run({"penalty": (_penalty_after_forward,)})


_results: dict = {}


def results(world: int) -> list[dict]:
    """Every rank's outcomes, from one launch per world size shared by the tests."""
    if world not in _results:
        _results[world] = launch(_run_2 if world == 2 else _run_4, world)
    return _results[world]


def _max_error(params: dict, truth: dict) -> float:
    return max(float((params[n] - truth[n]).abs().max()) for n in truth)


def _plain_model_numbers(out: dict) -> None:
    assert "crashed" not in out, out
    assert out["params"].keys() == out["plain"].keys()  # a tie is one parameter in both
    for name, value in out["plain"].items():
        torch.testing.assert_close(out["params"][name], value, msg=name)


@pytest.mark.parametrize("kind", ("tie", "new_dtensor"))
@pytest.mark.parametrize("name", TWINSHARD)
def test_parameter_assigned_after_forward_is_used(name, kind):
    for out in results(2):
        assert out[kind, name]["kept"], f"{name} dropped the assigned parameter"
        _plain_model_numbers(out[kind, name])


@pytest.mark.parametrize("kind", ("tie", "new_dtensor"))
def test_torch_ignores_a_parameter_assigned_after_forward(kind):
    for out in results(2):
        theirs = out[kind, TORCH]
        assert "crashed" not in theirs, theirs
        assert not theirs["kept"], "torch now keeps the assigned parameter: update the docs"
        assert _max_error(theirs["params"], theirs["plain"]) > 1e-2


@pytest.mark.parametrize("name", TWINSHARD)
def test_penalty_after_forward_keeps_its_gradient(name):
    for out in results(4):
        _plain_model_numbers(out["penalty", name])


def test_torch_drops_the_gradient_of_a_penalty_after_forward():
    """torch trains as if the penalty were not in the loss."""
    for out in results(4):
        theirs = out["penalty", TORCH]
        assert "crashed" not in theirs, theirs
        assert _max_error(theirs["params"], theirs["plain"]) > 1e-2
        for name, value in theirs["dropped"].items():
            torch.testing.assert_close(theirs["params"][name], value, msg=name)
