"""Both implementations under the whole conformance suite, on gloo, with no expected failures.

Each training case compares the implementation, every step, with the plain model (the
truth) and with torch's fully_shard; the optimized path is also compared with the reference,
bitwise in fp32 at world sizes 1 and 2. Every case of one mesh runs inside one process group
(spawning once per mesh keeps the suite fast); each (implementation, mesh, case) is then its
own test, which fails with the case's worst mismatches.
"""

import json
import os

import pytest

from twinshard.conformance.suite import applicable, mesh_name, parse_meshes, run_suite

MESHES = {
    "twinshard.reference": parse_meshes("1,2,3,2x2,4"),
    "twinshard.optimized": parse_meshes("1,2,3,2x2"),
}
PARAMS = [(impl, mesh_name(m), n) for impl, meshes in MESHES.items()
          for m in meshes for n in applicable(m, None)]
_cache: dict[str, dict] = {}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    def get(impl):
        if impl not in _cache:
            rows = run_suite(impl, MESHES[impl], tmpdir=str(tmp_path_factory.mktemp("parity")))
            report = os.environ.get("TWINSHARD_PARITY_REPORT")
            if report:
                with open(f"{report}.{impl}.json", "w") as f:
                    json.dump(rows, f, indent=1, default=str)
            _cache[impl] = {(r["mesh"], r["case"]): r for r in rows}
        return _cache[impl]
    return get


@pytest.mark.parametrize("impl,mesh,name", PARAMS,
                         ids=[f"{i.rsplit('.', 1)[-1]}-{m}-{n}" for i, m, n in PARAMS])
def test_case(results, impl, mesh, name):
    result = results(impl).get((mesh, name))
    assert result is not None, f"case {name} did not run on mesh {mesh}"
    assert result["compared"] > 0, f"case {name} compared nothing"
    assert result["ok"], "\n".join(result["failures"][:5])


def test_reference_ran_every_group_on_every_mesh(results):
    rows = results("twinshard.reference")
    for mesh in map(mesh_name, MESHES["twinshard.reference"]):
        seen = {r["group"] for (m, _), r in rows.items() if m == mesh}
        assert {"training", "gradients", "mixed_precision", "state_dict", "api", "offload",
                "errors", "trace"} <= seen, (mesh, seen)


def test_optimized_was_compared_bitwise_with_the_reference(results):
    rows = results("twinshard.optimized")
    series = {s for (m, _), r in rows.items() if m in ("1", "2") for s in r["worst_by"]}
    assert "optimized vs reference" in series, series
