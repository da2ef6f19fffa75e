"""``fully_shard`` on the whole SPMD mesh (``dp_mesh_dims``) against torch's (issue 31, items 2
and 3): the same program under torch's ``fully_shard``, the reference and the optimized path on
two gloo ranks.

- Every parameter a ``Replicate`` DTensor on a mesh of data-parallel dims only, as torchtitan's
  ``--parallelism.spmd-backend full_dtensor`` makes it, inputs ``Shard(0)`` DTensors: twinshard
  crashed (``IndexError`` in ``tp_layout``); now the losses and every shard equal torch's bit
  for bit, and the sharded, unsharded and gradient DTensors have torch's meshes and placements.
  The meshes: FSDP's one dim; HSDP's two, each way round on two ranks; and dp with a tensor-
  parallel dim of size 1 (the whole-mesh path with a TP dim, whose unsharded parameter torch
  keeps on the whole mesh).
- ``dp_mesh_dims`` with plain parameters: torch refuses it (``ValueError``); twinshard accepted
  it, and now raises a ``ValueError`` that starts with torch's words.
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

# name -> (mesh shape, its dim names, DataParallelMeshDims(**dims) or None: not passed)
MESHES = {
    "fsdp": ((2,), ("dp_shard",), {"shard": "dp_shard"}),
    "hsdp_1x2": ((1, 2), ("dp_replicate", "dp_shard"), {"shard": "dp_shard", "replicate": "dp_replicate"}),
    "hsdp_2x1": ((2, 1), ("dp_replicate", "dp_shard"), {"shard": "dp_shard", "replicate": "dp_replicate"}),
    "dp_tp_1": ((2, 1), ("dp_shard", "tp"), {"shard": "dp_shard"}),
}  # fmt: skip
NO_DIMS = "fsdp_without_dp_mesh_dims"  # the fsdp mesh, dp_mesh_dims not passed


class MLP(nn.Module):
    """Uneven rows (15 over 2 ranks) so that a padded shard is compared too."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(8, 15), nn.Linear(15, 8)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


def _placed(t) -> tuple:
    return type(t).__name__, str(getattr(t, "placements", None)), str(getattr(t, "device_mesh", ""))


def _full_dtensor(impl, mesh, dims) -> dict:
    """Every parameter ``Replicate`` on ``mesh``, each group sharded over the dims ``dims``
    names; three SGD steps on ``Shard(0)`` DTensor inputs, the loss a DTensor (torchtitan's
    ``full_dtensor``)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    model, replicate = MLP(), [Replicate()] * mesh.ndim
    for m in (model.w1, model.w2):
        for name, p in list(m.named_parameters()):
            setattr(m, name, nn.Parameter(distribute_tensor(p.detach(), mesh, replicate)))
    kwargs = {"dp_mesh_dims": impl.DataParallelMeshDims(**dims)} if dims else {}
    impl.fully_shard(model.w1, mesh=mesh, **kwargs)
    impl.fully_shard(model, mesh=mesh, **kwargs)
    forms = {"sharded": {n: _placed(p) for n, p in model.named_parameters()}}

    def first_forward(module, args):  # the unsharded parameter, as the layer computes with it
        forms.setdefault("unsharded", _placed(module.weight))

    model.w1.register_forward_pre_hook(first_forward)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # the batch is cut over the data-parallel dims (all of them without dims) and replicated
    # over the others: ranks that differ only there see the same rows
    dp = (
        set()
        if dims is None
        else {n for k in dims.values() for n in ((k,) if isinstance(k, str) else k)}
    )
    names = mesh.mesh_dim_names
    on_dp = [dims is None or n in dp for n in names]
    coords = [c for c, keep in zip(mesh.get_coordinate(), on_dp) if keep]
    generator = torch.Generator().manual_seed(int("".join(map(str, coords)) or "0"))
    inputs = [Shard(0) if keep else Replicate() for keep in on_dp]
    losses = []
    for _ in range(3):
        x = DTensor.from_local(torch.randn(4, 8, generator=generator), mesh, inputs)
        loss = model(x).pow(2).sum()
        loss.backward()
        forms["grad"] = {n: _placed(p.grad) for n, p in model.named_parameters()}
        optim.step()
        optim.zero_grad()
        losses.append(loss.full_tensor().item())
    local = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    return {**forms, "losses": losses, "local": local}


def _plain_with_dp_mesh_dims(impl, mesh, dims):
    """Plain parameters, dp_mesh_dims given: the exception's classes and message, or None."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    try:
        impl.fully_shard(model[1], mesh=mesh, dp_mesh_dims=impl.DataParallelMeshDims(**dims))
    except Exception as error:  # noqa: BLE001 - the type is what is compared
        return [c.__name__ for c in type(error).__mro__], isinstance(error, ValueError), str(error)
    return None


def _int_reshard_with_dp_mesh_dims(impl, mesh, dims):
    """``reshard_after_forward=2`` with ``dp_mesh_dims``: the exception's classes and message,
    or None. (With a tensor-parallel dim on 8 ranks twinshard hung here: rows of 2 ranks of a
    mesh that is part of the world, built differently on each rank.)"""
    from torch.distributed.tensor import Replicate, distribute_tensor

    model = MLP()
    for name, p in list(model.w1.named_parameters()):
        setattr(model.w1, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()])))
    dp = impl.DataParallelMeshDims(**dims)
    try:
        impl.fully_shard(model.w1, mesh=mesh, dp_mesh_dims=dp, reshard_after_forward=2)
    except Exception as error:  # noqa: BLE001 - the type is what is compared
        return [c.__name__ for c in type(error).__mro__], str(error)
    return None


def _run() -> dict:
    """Each check under each implementation, on one mesh per shape: torch's SPMD path wants
    the parameters' mesh to be the very object passed to fully_shard."""
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {case: init_device_mesh("cpu", shape, mesh_dim_names=names)
              for case, (shape, names, _) in MESHES.items()}  # fmt: skip
    checks = {(case, "train"): (_full_dtensor, meshes[case], dims)
              for case, (_, _, dims) in MESHES.items()}  # fmt: skip
    checks[NO_DIMS, "train"] = (_full_dtensor, meshes["fsdp"], None)
    for case in ("fsdp", "hsdp_1x2"):
        checks[case, "plain"] = (_plain_with_dp_mesh_dims, meshes[case], MESHES[case][2])
    checks["fsdp", "int"] = (_int_reshard_with_dp_mesh_dims, meshes["fsdp"], MESHES["fsdp"][2])
    out = {}
    for (case, check), (fn, mesh, dims) in checks.items():
        for name in IMPLS:
            try:
                out[case, check, name] = fn(importlib.import_module(name), mesh, dims)
            except Exception as error:  # noqa: BLE001 - reported by the test that reads it
                out[case, check, name] = {"crashed": f"{type(error).__name__}: {error}"}
    return out


_results: list = []


def results() -> list[dict]:
    """Every rank's outcomes, from one launch shared by the tests."""
    if not _results:
        _results.extend(launch(_run, 2))
    return _results


@pytest.mark.parametrize("case", MESHES)
@pytest.mark.parametrize("name", TWINSHARD)
def test_data_parallel_only_dtensor_parameters_train_as_torch(name, case):
    for out in results():
        mine, theirs = out[case, "train", name], out[case, "train", TORCH]
        assert "crashed" not in theirs, theirs
        assert "crashed" not in mine, f"{name}: {mine}"
        for form in ("sharded", "unsharded", "grad"):
            assert mine[form] == theirs[form], (form, mine[form], theirs[form])
        assert mine["losses"] == theirs["losses"]  # bitwise: the same reductions in order
        for param, value in theirs["local"].items():
            assert torch.equal(mine["local"][param], value), param


def test_replicate_on_the_dp_mesh_without_dp_mesh_dims_trains_where_torch_refuses():
    """The same parameters with ``mesh=`` the dp mesh and no ``dp_mesh_dims``: torch's TP path
    joins the parameter's mesh to the dp mesh and refuses; twinshard reads the dp dims off the
    parameter and trains exactly what torch trains with ``dp_mesh_dims``."""
    for out in results():
        refused = out[NO_DIMS, "train", TORCH]
        assert refused.get("crashed", "").startswith("RuntimeError: Cannot concatenate"), refused
        for name in TWINSHARD:
            mine, theirs = out[NO_DIMS, "train", name], out["fsdp", "train", TORCH]
            assert mine["losses"] == theirs["losses"], name
            assert all(torch.equal(mine["local"][p], v) for p, v in theirs["local"].items())


@pytest.mark.parametrize("case", ("fsdp", "hsdp_1x2"))
@pytest.mark.parametrize("name", TWINSHARD)
def test_plain_parameters_with_dp_mesh_dims_are_refused_as_torch(name, case):
    for out in results():
        theirs, mine = out[case, "plain", TORCH], out[case, "plain", name]
        assert theirs is not None and theirs[1], f"the control: torch raises a ValueError {theirs}"
        assert theirs[2].startswith("When dp_mesh_dims is provided, all parameters must be")
        assert mine is not None, f"{name} accepts plain parameters with dp_mesh_dims"
        classes, is_value_error, message = mine
        assert is_value_error and "ValueError" in classes, classes  # pytest.raises(ValueError)
        assert message.startswith(theirs[2]) and len(message) > len(theirs[2]), message


@pytest.mark.parametrize("name", TWINSHARD)
def test_an_int_reshard_after_forward_with_dp_mesh_dims_is_refused_as_torch(name):
    for out in results():
        theirs, mine = out["fsdp", "int", TORCH], out["fsdp", "int", name]
        assert theirs is not None and "NotImplementedError" in theirs[0], theirs  # the control
        assert mine is not None, f"{name} accepts it"
        assert "NotImplementedError" in mine[0] and "FSDPUsageError" in mine[0], mine
        assert mine[1].startswith(theirs[1]) and "pass True or False" in mine[1], mine


# Issue 34, item 3: dp_mesh_dims in full, on 4 ranks. Several dims of a kind flattened into one
# (torchtitan's dp_shard x cp), HSDP with either kind flattened, and replicate alone (DDP: the
# parameters stay whole, gradients all-reduced), with and without a dim that is not data parallel.
MESHES4 = {
    "flat_shard": ((2, 2), ("dp_shard", "cp"), {"shard": ("dp_shard", "cp")}),
    "flat_shard_tp": ((2, 1, 2), ("dp_shard", "cp", "tp"), {"shard": ("dp_shard", "cp")}),
    "hsdp_flat_shard": ((2, 1, 2), ("dp_replicate", "dp_shard", "cp"),
                        {"replicate": "dp_replicate", "shard": ("dp_shard", "cp")}),
    "hsdp_flat_replicate": ((1, 2, 2), ("pp_free", "dp_replicate", "dp_shard"),
                            {"replicate": ("pp_free", "dp_replicate"), "shard": "dp_shard"}),
    "ddp": ((4,), ("dp_replicate",), {"replicate": "dp_replicate"}),
    "ddp_flat": ((2, 2), ("dp_replicate", "cp"), {"replicate": ("dp_replicate", "cp")}),
    "ddp_tp": ((2, 2), ("dp_replicate", "tp"), {"replicate": "dp_replicate"}),
}  # fmt: skip


def _run4() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    for case, (shape, names, dims) in MESHES4.items():
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        for name in IMPLS:
            try:
                out[case, name] = _full_dtensor(importlib.import_module(name), mesh, dims)
            except Exception as error:  # noqa: BLE001 - reported by the test that reads it
                out[case, name] = {"crashed": f"{type(error).__name__}: {error}"}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
    for name in TWINSHARD:  # a dim the mesh lacks
        impl = importlib.import_module(name)
        dims = impl.DataParallelMeshDims(shard=("dp_shard", "context"))
        try:
            impl.fully_shard(MLP(), mesh=mesh, dp_mesh_dims=dims)
            out["unknown_dim", name] = None
        except ValueError as error:
            out["unknown_dim", name] = str(error)
    return out


_results4: list = []


def _launch4() -> list:
    if not _results4:
        _results4.extend(launch(_run4, 4))
    return _results4


@pytest.mark.parametrize("name", TWINSHARD)
def test_a_dim_the_mesh_lacks_is_named(name):
    for out in _launch4():
        message = out["unknown_dim", name]
        assert message is not None and "['context']" in message and "cp" in message, message


@pytest.mark.parametrize("case", MESHES4)
@pytest.mark.parametrize("name", TWINSHARD)
def test_several_dims_flattened_and_replicate_only_train_as_torch(name, case):
    # The reference all-reduces each parameter over 4 replicas alone, torch (and the optimized
    # path) a group's flat buffer: gloo's ring sums each chunk in another order, so the two
    # agree to rounding only there (bitwise wherever a collective spans 2 ranks)
    exact = not (name == "twinshard.reference" and case in ("ddp", "ddp_flat"))
    for out in _launch4():
        mine, theirs = out[case, name], out[case, TORCH]
        assert "crashed" not in theirs, theirs
        assert "crashed" not in mine, f"{name}: {mine}"
        for form in ("sharded", "unsharded", "grad"):
            assert mine[form] == theirs[form], (form, mine[form], theirs[form])
        for param, value in theirs["local"].items():
            if exact:
                assert torch.equal(mine["local"][param], value), param
            else:
                torch.testing.assert_close(mine["local"][param], value)
        if exact:
            assert mine["losses"] == theirs["losses"]
        else:
            fp32 = (torch.tensor(mine["losses"]), torch.tensor(theirs["losses"]))  # float32
            torch.testing.assert_close(*fp32)
