"""twinshard on torch releases older than the one CI installs (the package declares torch>=2.11).

The first run on a GPU machine (torch 2.11) found that no twinshard module imported there:
``twinshard.api`` took ``DataParallelMeshDims`` from ``torch.distributed.fsdp``, which gained it
in 2.13. twinshard now keeps a class of its own with the same fields for older releases
(``twinshard/mesh_dims.py``). These tests check that class against torch's, and import the
implementations in a fresh interpreter whose torch has the name removed, as 2.11's lacks it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from torch.distributed.fsdp import DataParallelMeshDims as TorchDims

from twinshard.mesh_dims import DataParallelMeshDims

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
from twinshard.mesh_dims import DataParallelMeshDims
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
