"""twinshard on torch releases older than the one CI installs (the package declares torch>=2.11).

The first run on a GPU machine (torch 2.11) found that no twinshard module imported there:
``twinshard.api`` took ``DataParallelMeshDims`` from ``torch.distributed.fsdp``, which gained it
in 2.13. twinshard now keeps a class of its own with the same fields for older releases
(``twinshard/api/mesh_dims.py``). These tests check that class against torch's, and import the
implementations in a fresh interpreter whose torch has the name removed, as 2.11's lacks it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from torch.distributed.fsdp import DataParallelMeshDims as TorchDims

from twinshard.api.mesh_dims import DataParallelMeshDims

DIMS = [
    {"shard": "dp_shard"},
    {"replicate": "dp_replicate"},
    {"shard": "dp_shard", "replicate": "dp_replicate"},
    {"shard": ("dp_shard", "cp"), "replicate": ["r1", "r2"]},
]


@pytest.mark.parametrize("dims", DIMS)
def test_the_stand_in_names_the_dims_as_torchs_class_does(dims):
    ours, torchs = DataParallelMeshDims(**dims), TorchDims(**dims)
    assert (ours.shard_names, ours.replicate_names) == (torchs.shard_names, torchs.replicate_names)
    assert (ours.shard, ours.replicate) == (torchs.shard, torchs.replicate)


def test_the_stand_in_refuses_no_dims_as_torchs_class_does():
    with pytest.raises(ValueError):
        TorchDims()
    with pytest.raises(ValueError, match="needs shard or replicate"):
        DataParallelMeshDims()


WITHOUT_THE_NAME = """
import torch.distributed.fsdp as fsdp
del fsdp.DataParallelMeshDims  # as on torch 2.11 and 2.12
import twinshard.reference as reference, twinshard.optimized as optimized, twinshard.api as api
from twinshard.api.mesh_dims import DataParallelMeshDims
assert reference.DataParallelMeshDims is optimized.DataParallelMeshDims is DataParallelMeshDims
print(api.DataParallelMeshDims(shard="dp").shard_names)
"""


def test_the_implementations_import_where_torch_lacks_the_class():
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_THE_NAME], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "('dp',)"


def test_where_torch_has_the_class_twinshard_exports_torchs():
    import twinshard.reference

    assert twinshard.reference.DataParallelMeshDims is TorchDims


OLD_COLLECTIVE_NAMES = """
import json, torch
from twinshard.measure import simnet
simnet.init(4, simnet.parse_link("nvlink"))
group = simnet.SimProcessGroup(0, 4, "old-names")
x = torch.arange(6.0)
gathered, coalesced = torch.empty(24), [torch.empty(24), torch.empty(24)]
group._allgather_base(gathered, x).wait()
group.allgather_into_tensor_coalesced(coalesced, [x, 2 * x]).wait()
reduced, pair = torch.empty(6), [torch.empty(6), torch.empty(6)]
group._reduce_scatter_base(reduced, torch.arange(24.0)).wait()
group.reduce_scatter_tensor_coalesced(pair, [torch.arange(24.0), -torch.arange(24.0)]).wait()
print(json.dumps([gathered.tolist(), [c.tolist() for c in coalesced], reduced.tolist(),
                  [p.tolist() for p in pair], [c.op for c in simnet.network().calls]]))
"""


def test_the_simulated_network_answers_the_collective_names_of_older_torch():
    # torch 2.11 calls a Python process group's single-tensor collectives by their names before
    # 2.13's rename; the first H100 run found `bench --backend simnet --device cuda` failing
    # there with "No backend type associated with device type cuda"
    done = subprocess.run(
        [sys.executable, "-c", OLD_COLLECTIVE_NAMES], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    gathered, coalesced, reduced, pair, ops = json.loads(done.stdout)
    rows = list(range(6))
    assert gathered == rows * 4
    assert coalesced == [rows * 4, [2 * r for r in rows] * 4]
    assert reduced == [4 * r for r in rows]  # rank 0's block, summed over 4 equal ranks
    assert pair == [[4 * r for r in rows], [-4 * r for r in rows]]
    assert ops == ["all_gather"] * 3 + ["reduce_scatter"] * 3
