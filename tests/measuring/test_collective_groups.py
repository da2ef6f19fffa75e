"""The observers see each collective's own process group, not the whole world.

The device monitor (``twinshard/measure/monitor.py``) and the plan's step trace (``plan/trace.py``)
looked for a collective's group by the type name ``ProcessGroup``. A dispatch mode gets the group
boxed as a ``ScriptObject``, so that test never matched and every collective counted as one over
all W ranks: the plan priced HSDP's reduce-scatters and all-reduces as rings of the whole world.
Both now read the group from ``twinshard.dispatch.c10d.call``. Here: a 2x2 HSDP mesh on PyTorch's
fake process group (4 ranks played by one process), one step under the monitor: every
collective runs over 2 ranks, the shard group's (0, 1) or the replicas' (0, 2).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import sys, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from twinshard.measure.monitor import Monitor
import importlib
impl = importlib.import_module(sys.argv[1])
dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=4)
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
impl.fully_shard(model[0], mesh=mesh)
impl.fully_shard(model, mesh=mesh)
with Monitor("cpu") as monitor:
    monitor.begin("step")
    model(torch.randn(2, 8)).sum().backward()
calls = monitor.finish()[-1].collectives
print(sorted({(c.op, c.ranks) for c in calls}))
"""


@pytest.mark.parametrize("impl", ["twinshard.reference", "twinshard.optimized"])
def test_hsdp_collectives_run_over_their_own_groups(impl):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, impl], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = eval(done.stdout.strip().splitlines()[-1])  # [(op, ranks)], printed by the script
    assert seen, "the step issued no collective"
    groups = {ranks for _, ranks in seen}
    assert groups <= {(0, 1), (0, 2)}, seen  # never the whole world (0, 1, 2, 3)
    assert (0, 1) in groups and (0, 2) in groups, seen  # the shard group and the replicas
