"""Both implementations under the whole conformance suite, on gloo, with no expected failures.

Each training case compares the implementation, every step, with the plain model (the
truth). The optimized path is also compared with the reference at world sizes 1 and 2 (bitwise
in fp32) and with torch's fully_shard at world size 2; torch's fully_shard itself passes the
suite at 1, 2 and 3 (``tests/test_torch_conformance.py``). The reference runs at 1, 2, 3 and
2x2 (world size 4 is the optimized run's and the fuzzed test's). The optimized path runs a second
time with stand-in streams, at world size 2, HSDP 2x2, and HSDP with one shard (2x1, 3x1) and
with one replica (1x2, 1x3), where the reductions take their shortcuts: its accelerator
schedule on the CPU, every tensor access checked against the stream order (compared with the
plain model). The whole matrix in that mode is one command: ``twinshard conform
twinshard.optimized --stand-in-streams --no-oracles --world-sizes 1,2,3,2x2,4,2x1,1x2,3x1,1x3``.
The cost cases (``cost_*``) leave out the meshes that show them nothing new (``NOT_COST``).

The oracles double a case's cost, and CI's time on 2 cores is short, so each run compares with
them where they add a check and with the plain model elsewhere. Every case of one mesh runs
inside one process group (spawning once per mesh keeps the suite fast), launched when the
first test of that mesh asks, so no single test waits for more than one mesh (the stand-in
streams' six meshes took 12 minutes under coverage, past pytest's per-test limit on a slower
machine); each (run, mesh, case) is then its own test, which fails with the case's worst
mismatches, or is skipped with the reason the case gives for not applying to that mesh.
"""

import json
import os

import pytest
from coverage_scope import unmeasured

from twinshard.conformance.runner import select
from twinshard.conformance.suite import mesh_name, parse_meshes, run_suite

OPTIMIZED = "twinshard.optimized"
# The cost cases (what is communicated and kept alive) where a neighbouring mesh has nothing
# new to show them: the reference at 3 (the optimized path runs them there) and the stand-in
# streams at 3x1 and 1x3 (as at 2x1 and 1x2).
NOT_COST = [n for n in select(None) if not n.startswith("cost_")]
RUNS = {  # name -> (implementation, [(meshes, run_suite options)]), world size 2 first: its
    # dcp_save writes the checkpoint that dcp_load reads at the other world sizes
    "reference": (
        "twinshard.reference",
        [
            ("2,1", {"oracles": False}),
            ("3", {"oracles": False, "patterns": NOT_COST}),
            ("2x2", {"oracles": False}),
        ],
    ),
    "optimized": (
        OPTIMIZED,
        [
            ("2", {"oracles": True}),
            ("1", {"oracles": ("reference",)}),
            ("3,2x2,4", {"oracles": False}),
        ],
    ),
    "optimized-standin": (
        OPTIMIZED,
        [
            ("2,2x2,2x1,1x2", {"stand_in_streams": True, "oracles": False}),
            ("3x1,1x3", {"stand_in_streams": True, "oracles": False, "patterns": NOT_COST}),
        ],
    ),
}
MESHES = {  # run -> [(mesh, run_suite options)], in the order they run
    run: [(m, options) for spec, options in parts for m in parse_meshes(spec)]
    for run, (_, parts) in RUNS.items()
}
PARAMS = [
    (run, mesh_name(m), n)
    for run, meshes in MESHES.items()
    for m, options in meshes
    for n in select(options.get("patterns"))
]
_rows: dict[str, dict] = {}  # run -> {(mesh, case): row} of the meshes run so far
_folders: dict[str, str] = {}  # run -> the folder its meshes share (dcp_save's checkpoints)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    def get(run, mesh=None):
        """The rows of ``run``, once its meshes up to ``mesh`` (every one: None) have run.
        Each mesh is one process group, launched in order when the first test that needs
        it asks, so that no single test waits for more than one mesh."""
        impl = RUNS[run][0]
        rows = _rows.setdefault(run, {})
        folder = _folders.setdefault(run, str(tmp_path_factory.mktemp(run)))
        for shape, options in MESHES[run]:
            name = mesh_name(shape)
            if not any(m == name for m, _ in rows):
                with unmeasured(impl != OPTIMIZED):  # the reference runs no line of optimized/
                    new = run_suite(impl, [shape], tmpdir=folder, **options)
                rows.update({(r["mesh"], r["case"]): r for r in new})
                report = os.environ.get("TWINSHARD_PARITY_REPORT")
                if report:
                    with open(f"{report}.{run}.json", "w") as f:
                        json.dump(list(rows.values()), f, indent=1, default=str)
            if name == mesh:
                break
        return rows

    return get


@pytest.mark.parametrize("run,mesh,name", PARAMS, ids=[f"{r}-{m}-{n}" for r, m, n in PARAMS])
def test_case(results, run, mesh, name):
    result = results(run, mesh).get((mesh, name))
    assert result is not None, f"case {name} did not run on mesh {mesh}"
    if result["status"] == "SKIP":
        assert result["reason"], f"case {name} was skipped on mesh {mesh} without a reason"
        pytest.skip(result["reason"])
    assert result["compared"] > 0, f"case {name} compared nothing"
    assert result["ok"], "\n".join(result["failures"][:5])


def test_every_group_ran_on_every_mesh(results):
    for run in RUNS:
        rows = results(run)
        for mesh in (mesh_name(m) for m, _ in MESHES[run]):
            seen = {r["group"] for (m, _), r in rows.items() if m == mesh and r["status"] == "PASS"}
            assert {
                "training",
                "gradients",
                "mixed_precision",
                "state_dict",
                "api",
                "offload",
                "errors",
                "trace",
            } <= seen, (run, mesh, seen)


def test_optimized_was_compared_bitwise_with_the_reference(results):
    rows = results("optimized")
    series = {s for (m, _), r in rows.items() if m in ("1", "2") for s in r["worst_by"]}
    assert "optimized vs reference" in series, series
    at_two = {s for (m, _), r in rows.items() if m == "2" for s in r["worst_by"]}
    assert any("torch" in s for s in at_two), at_two  # and with torch's fully_shard
    bitwise = [
        r
        for (m, _), r in rows.items()
        if m in ("1", "2")
        and r["group"] != "mixed_precision"
        and "optimized vs reference" in r["worst_by"]
    ]
    assert bitwise and all(r["worst_by"]["optimized vs reference"]["abs"] == 0.0 for r in bitwise)


def test_skips_are_the_cases_own_conditions(results):
    rows = results("optimized")
    skipped = {(m, c) for (m, c), r in rows.items() if r["status"] == "SKIP"}
    assert ("4", "trace_reshard_int") not in skipped  # a shard group of 4: 2 differs from True
    assert ("4", "cost_reshard_int") not in skipped and ("4", "cost_reshard_int") in rows
    assert ("2x2", "no_all_reduce") not in skipped and ("2", "no_all_reduce") in skipped
