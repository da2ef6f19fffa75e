"""What every test module shares: the session's accounting and rank worlds, the tiers, the
time limits, and the fixtures several modules use.

- ``support/`` holds the helpers; it is on ``sys.path`` here and in every rank.
- Every Python process of the session is logged, and where the time went is printed at the
  end (``support/timing.py``, ``support/breakdown.py``).
- A launch of N ranks runs in the session's world of N ranks (``support/shared_worlds.py``);
  tests of launching itself are marked ``real_launch`` and start their own ranks.
  ``TWINSHARD_FRESH_RANKS=1`` starts fresh ranks for every launch, to hunt a state leak.
- Tiers: the default run checks every case, mesh and planted bug once; tests marked ``full``
  only repeat a check on more combinations and run with ``--full`` (README.md, "Tiers").
- Both cores: fixtures that run in a process of their own (the documentation site's build, the
  fake accelerator's run) start in the background once collection is done, on the core the
  ranks leave idle, and the tests that read them run last (``support/background.py``).
- Time limits: each test gets ``TEST_LIMIT`` seconds, plus the budget of each expensive
  session fixture it asks for (``FIXTURE_LIMITS``), so that the first test to need one can
  build it; the whole session stops at pytest-timeout's ``session_timeout``.
- A second lane: the measuring commands' files run in a pytest of their own at a lower
  priority, once the background jobs are done, on the CPU the session leaves idle, and are
  reported here (``support/second_lane.py``).
- A test of a module outside ``MEASURED_MODULES`` runs its ranks without coverage.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "support"))

import background  # noqa: E402
import second_lane  # noqa: E402
import shared_worlds  # noqa: E402
import timing  # noqa: E402
from coverage_scope import MEASURED_MODULES, unmeasured  # noqa: E402
from docs_site import browser, server, site, site_build  # noqa: E402, F401 - the site's fixtures
from timing import pytest_runtest_logreport, pytest_terminal_summary  # noqa: E402, F401
from train_support import run_train  # noqa: E402

timing.start()

TEST_LIMIT = 300  # seconds; also pyproject.toml's timeout
# Session fixtures whose first user builds them, and the seconds each may add to its limit.
FIXTURE_LIMITS = {"site_build": 1500, "fake_accelerator_run": 600, "short_run": 300}


def pytest_addoption(parser):
    parser.addoption(
        "--full",
        action="store_true",
        help="also run the full tier: the tests marked 'full', which repeat checks the "
        "default run makes on more combinations (README.md, 'Tiers')",
    )


def pytest_configure(config):
    import suite_runs  # the conformance runs' parts, some of them tier-dependent

    second_lane.configure(config)
    suite_runs.FULL_TIER = config.getoption("--full")
    config.addinivalue_line(
        "markers", "full: repeats a check on more combinations; runs only with --full"
    )
    config.addinivalue_line(
        "markers",
        "real_launch: a test of launching itself; its launches start ranks of their own "
        "instead of using the session's shared worlds",
    )


def pytest_collection_modifyitems(config, items):
    second_lane.keep_mine(items)
    if not config.getoption("--full"):
        kept = [item for item in items if item.get_closest_marker("full") is None]
        if len(kept) < len(items):
            config.hook.pytest_deselected(
                items=[item for item in items if item.get_closest_marker("full") is not None]
            )
            items[:] = kept
    for item in items:
        extra = sum(FIXTURE_LIMITS.get(name, 0) for name in getattr(item, "fixturenames", ()))
        if extra:
            own = item.get_closest_marker("timeout")
            limit = own.args[0] if own is not None and own.args else TEST_LIMIT
            item.add_marker(pytest.mark.timeout(limit + extra), append=False)
    if not config.option.collectonly:
        # The measuring commands' files go to the second lane, on the core left idle.
        second_lane.split(config, items, timing.FOLDER)
        # The fixtures built by a process of their own (the site, the fake accelerator's run)
        # start now, on the core the ranks leave idle; the tests that read them run last.
        waiting = set(background.start_needed(items))
        items[:] = [item for item in items if item not in waiting] + [
            item for item in items if item in waiting
        ]


def pytest_sessionstart(session):
    shared_worlds.start()


@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session):
    """The session's own tests, then the second lane's, reported once it is done."""
    second_lane.count(session)
    result = yield
    limit = float(session.config.getini("session_timeout") or 2700)
    second_lane.join(session, limit - (time.monotonic() - timing.STARTED))
    return result


def pytest_runtest_logfinish(nodeid, location):
    second_lane.start_when(not background.running())  # once the site is built


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    shared_worlds.finish(timing.FOLDER)
    background.stop_all()
    second_lane.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Run a test of a module outside ``MEASURED_MODULES`` (its fixtures included) unmeasured,
    and a test marked ``real_launch`` with ranks of its own."""
    module = getattr(getattr(item, "module", None), "__name__", "").rpartition(".")[2]
    with unmeasured(module not in MEASURED_MODULES), shared_worlds.launches_for(item):
        return (yield)


@pytest.fixture(scope="session")
def full_tier(request) -> bool:
    """Whether this session runs the full tier (``--full``)."""
    return request.config.getoption("--full")


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
