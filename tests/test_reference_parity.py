"""The reference against the truth (plain model) and torch's fully_shard, on gloo.

Every conformance case runs inside one process group per mesh (world sizes 1, 2, 3, 4 and
HSDP 2x2): spawning once per mesh keeps the suite fast. Each case then becomes its own test,
which fails with the case's worst mismatches.
"""

import json
import os

import pytest

from twinshard.conformance.cases import CASES, Context
from twinshard.conformance.runner import run_cases
from twinshard.launch import launch

# World size 2 goes first: its dcp_save case writes the checkpoints that dcp_load reads at
# the other sizes.
MESHES = [(2,), (1,), (3,), (2, 2), (4,)]


def _applies(shape, name):
    return CASES[name].needs(Context(None, "", None, shape, ""))


PAIRS = [(shape, name) for shape in MESHES for name in CASES if _applies(shape, name)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity")
    out = {}
    for shape in MESHES:
        world = 1
        for n in shape:
            world *= n
        rows = launch(run_cases, world, "twinshard.reference", shape, str(tmp), timeout=600)[0]
        out[shape] = {r["case"]: r for r in rows}
    report = os.environ.get("TWINSHARD_PARITY_REPORT")
    if report:
        with open(report, "w") as f:
            json.dump({"x".join(map(str, k)): v for k, v in out.items()}, f, indent=1)
    return out


@pytest.mark.parametrize("shape,name", PAIRS, ids=[f"{'x'.join(map(str, s))}-{n}" for s, n in PAIRS])
def test_case(results, shape, name):
    result = results[shape].get(name)
    assert result is not None, f"case {name} did not run on mesh {shape}"
    assert result["compared"] > 0, f"case {name} compared nothing"
    assert result["ok"], "\n".join(result["failures"][:5])


def test_every_mesh_ran_every_group(results):
    groups = {CASES[n].group for n in CASES}
    for shape in MESHES:
        seen = {r["group"] for r in results[shape].values()}
        assert {"training", "gradients", "mixed_precision", "state_dict"} <= seen, (shape, seen)
    assert groups >= {"training", "gradients", "mixed_precision", "offload", "api",
                      "state_dict", "checkpoint", "errors"}
