"""Fixtures shared by several test modules."""

from __future__ import annotations

from pathlib import Path

import pytest
from coverage_scope import MEASURED_MODULES, unmeasured
from docs_site import browser, server, site  # noqa: F401 - the site's fixtures, for every module
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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Run a test of a module outside ``MEASURED_MODULES`` (its fixtures included) unmeasured."""
    module = getattr(getattr(item, "module", None), "__name__", "").rpartition(".")[2]
    with unmeasured(module not in MEASURED_MODULES):
        return (yield)
