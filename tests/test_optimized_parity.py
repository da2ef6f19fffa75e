"""The optimized implementation under the whole conformance suite, with no expected failures:
against the plain model, against torch's fully_shard, and bitwise equal to the reference in
fp32 at world sizes 1 and 2 (each training case compares the two)."""

import pytest

from twinshard.conformance.suite import applicable, mesh_name, parse_meshes, run_suite

MESHES = parse_meshes("1,2,3,2x2")
PAIRS = [(mesh_name(m), n) for m in MESHES for n in applicable(m, None)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    rows = run_suite("twinshard.optimized", MESHES, tmpdir=str(tmp_path_factory.mktemp("opt")))
    return {(r["mesh"], r["case"]): r for r in rows}


@pytest.mark.parametrize("mesh,name", PAIRS, ids=[f"{m}-{n}" for m, n in PAIRS])
def test_case(results, mesh, name):
    result = results.get((mesh, name))
    assert result is not None, f"case {name} did not run on mesh {mesh}"
    assert result["compared"] > 0, f"case {name} compared nothing"
    assert result["ok"], "\n".join(result["failures"][:5])


def test_bitwise_against_the_reference_was_checked(results):
    series = {s for (m, _), r in results.items() if m in ("1", "2") for s in r["worst_by"]}
    assert "optimized vs reference" in series, series
