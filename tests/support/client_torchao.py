"""torchao's float8 training under each FSDP implementation, for tests/ecosystem/test_torchao_float8.py.

The model is a stack of three ``nn.Linear`` (dims multiples of 16, as float8 matmuls need),
converted by ``torchao.float8.convert_to_float8_training`` with
``enable_fsdp_float8_all_gather=True``: each weight becomes a tensor subclass whose
``fsdp_pre_all_gather`` casts its shard to float8 (e4m3) at a scale of the whole weight's
largest magnitude, and ``precompute_float8_dynamic_scale_for_fsdp`` after each optimizer step
computes those scales for every weight at once. Every linear is sharded, then the root.

- ``sharded(impl)``: one rank of a gloo run (``launch``): 3 steps of AdamW on this rank's
  slice of each batch; the losses, the collectives (``conformance.trace``) and the full
  parameters at the end.
- ``plain(world)``: the same model unsharded, under the same float8 casts: every rank's slice
  through it in turn, the gradients averaged over the slices (so each activation is cast at
  the scale of the slice a rank saw).
- ``python client_torchao.py IMPL WORLDS``: the collectives of the same 3 steps on the fake
  accelerator (``twinshard.measure.fakedevice``: one process as rank 0 of each of ``WORLDS``,
  such as ``2,4``, tensors without data), printed as JSON by world: torch's ``fully_shard`` runs there, where gloo, which has
  no float8 dtype, stops it.
"""

from __future__ import annotations

import importlib
import json
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

DIM, HIDDEN, BATCH, STEPS = 32, 64, 16, 3


def build(device="cpu") -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    with torch.device(device):
        layers = [nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(HIDDEN, DIM))
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    return convert_to_float8_training(model, config=config)


def batch(step: int) -> torch.Tensor:
    return torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(100 + step))


def _shard(impl, model: nn.Module, mesh) -> None:
    for layer in model:
        if isinstance(layer, nn.Linear):
            impl.fully_shard(layer, mesh=mesh)
    impl.fully_shard(model, mesh=mesh)


def _steps(model: nn.Module, world: int, rank: int, device) -> list[torch.Tensor]:
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = model(batch(step).chunk(world)[rank].to(device)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        precompute_float8_dynamic_scale_for_fsdp(model)
        losses.append(loss.detach().clone())
    return losses


def sharded(impl_name: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from twinshard.conformance.trace import CollectiveTrace

    world, rank = dist.get_world_size(), dist.get_rank()
    model = build()
    _shard(importlib.import_module(impl_name), model, init_device_mesh("cpu", (world,)))
    with CollectiveTrace() as seen:
        losses = _steps(model, world, rank, "cpu")
    return {
        "losses": losses,
        "calls": [(c.op, str(c.dtype), c.numel) for c in seen.calls],
        "params": {n: p.full_tensor().detach() for n, p in model.named_parameters()},
    }


def plain(world: int) -> dict:
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        per_rank = []
        for x in batch(step).chunk(world):
            loss = model(x).pow(2).mean()
            (loss / world).backward()
            per_rank.append(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(torch.stack(per_rank))
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}


def on_fake_accelerator(impl_name: str, world: int) -> list:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    from twinshard.conformance.trace import CollectiveTrace
    from twinshard.measure import fakedevice
    from twinshard.measure.world import join

    device = fakedevice.register()  # once a process; a second world leaves the first
    join("fakeaccel", world)
    mesh = init_device_mesh(device.type, (world,))  # outside the fake mode: the host's
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = build(device)
        _shard(importlib.import_module(impl_name), model, mesh)
        with CollectiveTrace() as seen:
            _steps(model, world, 0, device)
    return [(c.op, str(c.dtype), c.numel) for c in seen.calls]


if __name__ == "__main__":
    worlds = [int(w) for w in sys.argv[2].split(",")]
    print(json.dumps({w: on_fake_accelerator(sys.argv[1], w) for w in worlds}))
