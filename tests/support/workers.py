"""How the session's tests are split between pytest-xdist's workers (the README's command runs
two, ``-n 2``, one per core, with ``--dist loadgroup``).

A worker runs a whole group of tests; each test gets its group here (``group_tests``):

- tests that read one computed thing share a group, so that it is computed once, in one
  worker: the conformance suite's runs (``SHARED_RUNS``: ``test_parity.py`` and
  ``test_torch_conformance.py`` read the same runs, and the ranks that made the reference's
  keep its traces for the optimized path's oracles), and each fixture that a process of its own
  builds (``background.py``: the site, the fake accelerator's run) or that the training tests
  share (``short_run``);
- every other test is grouped with its module, whose module-scoped fixtures it shares.

The groups run longest first (``LONGEST_FIRST``): the conformance suite takes a third of the
session, so one worker starts on it while the other takes everything else.

``worker()`` says whether this process is a worker (``PYTEST_XDIST_WORKER``), ``None`` outside
xdist. Only the main process starts the session's logs, and only outside xdist does a fixture
built by a process of its own start in the background at collection: under xdist the worker
that runs its group starts it, while the other worker goes on with other tests.
"""

from __future__ import annotations

import os

import pytest

SHARED_RUNS = ("test_parity.py", "test_torch_conformance.py")
SHARED_FIXTURES = ("site_build", "fake_accelerator_run", "short_run")
LONGEST_FIRST = ("suite runs",)


def worker() -> str | None:
    return os.environ.get("PYTEST_XDIST_WORKER")


def group_of(item) -> str:
    if item.path.name in SHARED_RUNS:
        return "suite runs"
    for name in SHARED_FIXTURES:
        if name in getattr(item, "fixturenames", ()):
            return name
    return str(item.path)


def group_tests(items: list) -> None:
    """Give every test its xdist group (the module docstring), and put the groups of
    ``LONGEST_FIRST`` first."""
    groups = {}
    for item in items:
        groups[item] = group_of(item)
        item.add_marker(pytest.mark.xdist_group(name=groups[item]))
    items.sort(key=lambda item: groups[item] not in LONGEST_FIRST)  # stable: order kept
