"""Both implementations under the whole conformance suite, on gloo, with no expected failures.

Each training case compares the implementation, every step, with the plain model (the
truth). The optimized path is also compared with the reference at world sizes 1 and 2 (bitwise
in fp32), and with torch's fully_shard at world size 2; torch's fully_shard itself passes the
suite at 2 (and at 1 and 3 in the full tier, ``tests/suite/test_torch_conformance.py``). The
reference runs every case at 1 and 2, and at 3 and 2x2 in the full tier, where the optimized
path is compared with it too (within the tolerance; world size 4 is the optimized run's and the
fuzzed test's). At 3 and 2x2 the default tier runs the cases whose result depends on the mesh
(``suite_runs.MESH_BOUND``); the interface's cases run there in the full tier. The optimized
path runs a second time with stand-in streams, at world size 2, HSDP 2x2, and HSDP with one shard (2x1,
and 3x1 in the full tier) and with one replica (1x2, and 1x3 in the full tier), where the
reductions take their shortcuts (there the cases whose gradients reach the reductions each
another way, ``SHORTCUTS``; all in the full tier): its
accelerator schedule on the CPU, every tensor access checked against the stream order
(compared with the plain model). The whole matrix in that mode is one command: ``twinshard
conform twinshard.optimized --stand-in-streams --no-oracles --world-sizes
1,2,3,2x2,4,2x1,1x2,3x1,1x3``. The cost cases (``cost_*``) leave out the meshes that show them
nothing new (``NOT_COST``).

The runs and their meshes are ``support/suite_runs.py``'s: each mesh of each run is computed
once per session, when the first test of that mesh asks, so no single test waits for more than
one mesh; each (run, mesh, case) is then its own test, which fails with the case's worst
mismatches, or is skipped with the reason the case gives for not applying to that mesh.
"""

import pytest
from suite_runs import meshes, params, rows, selected

from twinshard.conformance.cases import CASES

RUNS = ("reference", "optimized", "optimized-standin")
PARAMS = params(RUNS)


@pytest.mark.parametrize("run,mesh,name", PARAMS, ids=["-".join(p.values) for p in PARAMS])
def test_case(run, mesh, name):
    result = rows(run, mesh, case=name).get((mesh, name))
    assert result is not None, f"case {name} did not run on mesh {mesh}"
    if result["status"] == "SKIP":
        assert result["reason"], f"case {name} was skipped on mesh {mesh} without a reason"
        pytest.skip(result["reason"])
    # a case that raised compared nothing: its traceback says why, so it is shown first
    assert result["ok"], "\n".join(result["failures"][:5])
    assert result["compared"] > 0, f"case {name} compared nothing"


def test_every_group_ran_on_every_mesh(full_tier):
    for run in RUNS:
        found = rows(run, full=full_tier)
        for mesh in meshes(run, full=full_tier):
            seen = {
                r["group"] for (m, _), r in found.items() if m == mesh and r["status"] == "PASS"
            }
            required = {
                "training",
                "gradients",
                "mixed_precision",
                "state_dict",
                "api",
                "offload",
                "errors",
                "trace",
            }
            # a mesh whose parts of this tier run some groups only (suite_runs.py says why)
            chosen = {CASES[n].group for n in selected(run, mesh, full=full_tier)}
            assert required & chosen <= seen, (run, mesh, seen)


def test_optimized_was_compared_bitwise_with_the_reference(full_tier):
    found = rows("optimized", full=full_tier)
    series = {s for (m, _), r in found.items() if m in ("1", "2") for s in r["worst_by"]}
    assert "optimized vs reference" in series, series
    at_two = {s for (m, _), r in found.items() if m == "2" for s in r["worst_by"]}
    assert any("torch" in s for s in at_two), at_two  # and with torch's fully_shard
    bitwise = [
        r
        for (m, _), r in found.items()
        if m in ("1", "2")
        and r["group"] != "mixed_precision"
        and "optimized vs reference" in r["worst_by"]
    ]
    assert bitwise and all(r["worst_by"]["optimized vs reference"]["abs"] == 0.0 for r in bitwise)


def test_skips_are_the_cases_own_conditions(full_tier):
    found = rows("optimized", full=full_tier)
    skipped = {(m, c) for (m, c), r in found.items() if r["status"] == "SKIP"}
    assert ("4", "trace_reshard_int") not in skipped  # a shard group of 4: 2 differs from True
    assert ("4", "cost_reshard_int") not in skipped and ("4", "cost_reshard_int") in found
    assert ("2x2", "no_all_reduce") not in skipped and ("2", "no_all_reduce") in skipped
