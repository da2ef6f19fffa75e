"""Two lanes for a session run with ``-n 2`` (pytest-xdist, ``--dist loadgroup``): each test
folder goes to one of two workers, which run side by side on the two cores.

A serial session leaves a core idle for much of its time: most tests wait on something (ranks
that meet at a collective, a watchdog's limit, a browser, a subprocess's start-up) as often as
they compute. So the README's command runs two workers, and each folder is given to one, by
``LANES``: the conformance suite's runs (read by three of its modules) stay in one worker and
are computed once, the documentation site and the fake accelerator's run (the background
jobs) in the other, and the two lanes are of about equal length (the CI breakdown's seconds).
Each worker has its own rank worlds. A session without ``-n`` runs every test in turn, as
before.

The background jobs start in the worker that runs their tests, as soon as it knows which lane
it has (its first test), not in both workers at collection.
"""

from __future__ import annotations

import os

import background
import pytest

# test folder -> lane; by the CI breakdown of e3e5165: suite 656 s, training 251 s, engine
# 138 s, structure 57 s, variants 55 s (1,157 s) against ecosystem 353 s, measuring 316 s and
# docs 285 s (954 s) with the site's build in the background of the same worker
LANES = {
    "suite": "runs",
    "training": "runs",
    "engine": "runs",
    "structure": "runs",
    "variants": "runs",
    "ecosystem": "pages",
    "measuring": "pages",
    "docs": "pages",
}
_started: list[str] = []  # the lane whose background jobs this worker started


def lane(item) -> str:
    parts = item.nodeid.split("/")
    return LANES.get(parts[1] if parts[0] == "tests" and len(parts) > 2 else "", "runs")


def in_worker() -> bool:
    return bool(os.environ.get("PYTEST_XDIST_WORKER"))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark each test with its lane, before pytest-xdist reads the marks (``--dist loadgroup``)."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        item.add_marker(pytest.mark.xdist_group(lane(item)))


def start_background(item) -> None:
    """In a worker, at its first test: start the background jobs of the tests of its lane."""
    if _started or not in_worker():
        return
    mine = lane(item)
    _started.append(mine)
    background.start_needed([i for i in item.session.items if lane(i) == mine])
