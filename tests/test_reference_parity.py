"""The reference against the truth (plain model) and torch's fully_shard, on gloo.

This is the conformance suite run on ``twinshard.reference`` at world sizes 1, 2, 3, 4 and
HSDP 2x2: every case runs inside one process group per mesh (spawning once per mesh keeps
the suite fast), then each (mesh, case) becomes its own test, which fails with the case's
worst mismatches. No expected failures are allowed for the reference.
"""

import json
import os

import pytest

from twinshard.conformance.suite import applicable, mesh_name, parse_meshes, run_suite

MESHES = parse_meshes("1,2,3,2x2,4")
PAIRS = [(mesh_name(m), n) for m in MESHES for n in applicable(m, None)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    rows = run_suite("twinshard.reference", MESHES, tmpdir=str(tmp_path_factory.mktemp("parity")))
    report = os.environ.get("TWINSHARD_PARITY_REPORT")
    if report:
        with open(report, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return {(r["mesh"], r["case"]): r for r in rows}


@pytest.mark.parametrize("mesh,name", PAIRS, ids=[f"{m}-{n}" for m, n in PAIRS])
def test_case(results, mesh, name):
    result = results.get((mesh, name))
    assert result is not None, f"case {name} did not run on mesh {mesh}"
    assert result["compared"] > 0, f"case {name} compared nothing"
    assert result["ok"], "\n".join(result["failures"][:5])


def test_every_mesh_ran_every_group(results):
    for mesh in map(mesh_name, MESHES):
        seen = {r["group"] for (m, _), r in results.items() if m == mesh}
        assert {"training", "gradients", "mixed_precision", "state_dict", "api", "offload",
                "errors", "trace"} <= seen, (mesh, seen)
