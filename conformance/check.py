"""The conformance suite as pytest tests; see ``twinshard.conformance.pytest_plugin``.

pytest --pyargs twinshard.conformance.check --fsdp-impl twinshard.reference
"""

import pytest

from .pytest_plugin import conformance_params


def pytest_generate_tests(metafunc):
    if "fsdp_case" in metafunc.fixturenames:
        pairs = conformance_params(metafunc.config)
        metafunc.parametrize("fsdp_case", pairs, ids=[f"{m}-{c}" for m, c in pairs])


def test_conformance(fsdp_conformance, fsdp_case):
    row = fsdp_conformance.get(*fsdp_case)
    if row["status"] == "SKIP":
        pytest.skip(row["reason"])
    if row["status"] == "XFAIL":
        pytest.xfail(row["reason"])
    if row["status"] == "XPASS":
        pytest.fail(f"expected to fail ({row['reason']}) but passed: update the xfail file")
    assert row["ok"], "\n".join(row["failures"][:5])  # a case that raised: its traceback
    assert row["compared"] > 0, f"{fsdp_case}: the case compared nothing"
