"""Both implementations train under PyTorch's fake process group and a bare ``FakeTensorMode``,
as a memory estimator runs them (torchtitan's: the fake process group at the job's world size,
the model built on meta, sharded, moved with ``to_empty`` and trained inside the fake mode), with
no monitor of the project's to answer host reads (issue 34, item 4).

Before, the first backward stopped with ``DataDependentOutputException``: the guard read a
mesh's ranks out of its rank tensor, which the fake mode had made fake; an int
``reshard_after_forward`` built its mesh of rows the same way. Each setting is checked against
torch's ``fully_shard`` where torch's runs too: the sharded gradients' local shapes, parameter
by parameter, must be torch's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import importlib, json, sys
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from twinshard.api import MixedPrecisionPolicy
    from twinshard.models import Llama, LlamaConfig

    setting = sys.argv[1]
    world = 64
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=world)
    # the mesh is made on the host, before the fake mode, as torchtitan's estimator makes it
    shape, names = ((8, 8), ("replicate", "shard")) if setting == "hsdp" else ((world,), None)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    after_forward = 8 if setting == "reshard_to_8" else True
    out = {}
    for impl in sys.argv[2].split(","):
        module = "torch.distributed.fsdp" if impl == "torch" else f"twinshard.{impl}"
        fully_shard = importlib.import_module(module).fully_shard
        with FakeTensorMode():
            with torch.device("meta"):
                model = Llama(LlamaConfig.preset("tiny"))
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in model.blocks:
                fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=after_forward)
            fully_shard(model, mesh=mesh, mp_policy=mp)
            model.to_empty(device="cpu")
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            tokens = torch.randint(0, 100, (2, 16))
            for _ in range(2):
                model(tokens).float().mean().backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
            loss = model(tokens).float().mean()
            loss.backward()  # a third backward: its gradients are compared
            assert isinstance(loss, FakeTensor), type(loss)
            out[impl] = {
                n: [list(p.shape), list(p.grad.to_local().shape)]
                for n, p in model.named_parameters()
            }
    print(json.dumps(out))
    """
)


@pytest.mark.parametrize(
    "setting, impls",
    [
        ("one_dim", "torch,reference,optimized"),
        ("hsdp", "torch,reference,optimized"),
        # torch's own fully_shard stops here (its mesh of rows reads the fake rank tensor)
        ("reshard_to_8", "reference,optimized"),
    ],
)
def test_trains_under_a_bare_fake_mode_at_64_ranks(tmp_path, setting, impls):
    script = tmp_path / "estimate.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), setting, impls],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    shapes = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(shapes) == set(impls.split(","))
    shards = 8 if setting == "hsdp" else 64  # the ranks that share a parameter
    for impl, grads in shapes.items():  # every gradient a shard: its 1/shards of the rows
        for name, (whole, local) in grads.items():
            assert local[0] <= -(-whole[0] // shards) and local[1:] == whole[1:], (impl, name)
    if "torch" in shapes:
        assert shapes["reference"] == shapes["torch"]
        assert shapes["optimized"] == shapes["torch"]
    else:
        assert shapes["reference"] == shapes["optimized"]
