"""Fixtures shared by several test modules."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from train_support import run_train


# One short training run (2 ranks, 40 steps, a checkpoint every 10), shared by the training
# tests that read its log, checkpoints and export.
@pytest.fixture(scope="session")
def short_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("short") / "run"
    assert (
        run_train(
            "--out", out, "--steps", 40, "--checkpoint-every", 10, "--keep", 2, "--sample-length", 8
        )
        == 0
    )
    return out


# Coverage of optimized/ (the README's test command): `coverage run` passes its configuration
# to every Python subprocess through this variable, and a measured rank runs its Python about
# a third slower. Only the modules below run the optimized path in the ways the report needs
# (the whole conformance suite, with and without stand-in streams, the planted bugs and the
# drop-in features); the ranks of every other test run unmeasured, which keeps CI short.
COVERAGE_ENV = "COVERAGE_PROCESS_CONFIG"
MEASURED_MODULES = {
    "test_api",
    "test_conformance",
    "test_contract",
    "test_drop_in",
    "test_optimized_schedule",
    "test_parity",
    "test_stream_order",
}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Run a test of an unlisted module (its fixtures included) without the variable."""
    module = getattr(item, "module", None)
    unmeasured = getattr(module, "__name__", "").rpartition(".")[2] not in MEASURED_MODULES
    saved = os.environ.pop(COVERAGE_ENV, None) if unmeasured else None
    try:
        return (yield)
    finally:
        if saved is not None:
            os.environ[COVERAGE_ENV] = saved
