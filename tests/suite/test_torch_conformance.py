"""torch's own ``fully_shard`` passes the conformance suite against the plain model at world
size 2 (and 1 and 3 in the full tier), with the expected failures of
``conformance/xfail/torch.distributed.fsdp.txt`` (each with its reason): the cases are right
about FSDP, not only about twinshard. The run is
``support/suite_runs.py``'s ``torch`` run (its ranks run outside coverage, see conftest); at
world size 2 the optimized run's torch oracle already trained each case, so the ranks read
those runs back instead of training them again."""

import pytest
from suite_runs import meshes, rows

from twinshard.conformance.suite import apply_xfail, default_xfail, load_xfail

EXPECTED = load_xfail(default_xfail("torch.distributed.fsdp"))
FULL_ONLY = set(meshes("torch")) - set(meshes("torch", full=False))


def _rows(mesh: str) -> list[dict]:
    found = [dict(r) for (m, _), r in rows("torch", mesh).items() if m == mesh]
    return apply_xfail(found, EXPECTED)


@pytest.mark.parametrize(
    "mesh",
    [pytest.param(m, marks=[pytest.mark.full] if m in FULL_ONLY else []) for m in meshes("torch")],
)
def test_torch_fully_shard_passes_with_its_expected_failures(mesh):
    found = _rows(mesh)
    bad = [(r["case"], r["status"], r["failures"][:2]) for r in found]
    bad = [b for b in bad if b[1] not in ("PASS", "XFAIL", "SKIP")]
    assert not bad, bad
    assert all(r["reason"] for r in found if r["status"] in ("XFAIL", "SKIP"))
    ran = [r for r in found if r["status"] != "SKIP"]
    assert sum(r["status"] == "PASS" for r in ran) > 0.8 * len(ran), "most cases must pass"
