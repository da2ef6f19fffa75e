"""The test session's rank worlds (``twinshard.ranks.worlds``), as pytest hooks that conftest.py takes in.

One world of N ranks per N, started when a test first launches N ranks and reused by every
later launch of N ranks in the session; ``launch`` sends each call there (same results, same
errors). Tests of launching itself carry the marker ``real_launch``: their launches start
processes of their own. ``TWINSHARD_FRESH_RANKS=1`` turns the worlds off for the whole session,
so that every launch starts fresh processes as before (to hunt a state leak between tests: a
test that passes that way and fails in the shared worlds depends on what an earlier task left).

At the end the session writes every task it ran (``build/tests/tasks.jsonl``: the test, the
ranks, the task, seconds) for the breakdown.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib

from twinshard.ranks import launch
from twinshard.ranks.worlds import Worlds, serving

FRESH_ENV = "TWINSHARD_FRESH_RANKS"
MARKER = "real_launch"

_session: dict = {}


def fresh() -> bool:
    return os.environ.get(FRESH_ENV, "0") not in ("", "0")


class SessionWorlds(Worlds):
    """``Worlds`` whose log also names the test that sent each task."""

    def run(self, fn, nprocs, *args, **kwargs):
        try:
            return super().run(fn, nprocs, *args, **kwargs)
        finally:
            test = os.environ.get("PYTEST_CURRENT_TEST", "").rpartition(" ")[0]
            self.log[-1]["test"] = test


def start() -> Worlds | None:
    """Serve the session's launches from shared worlds (unless ``TWINSHARD_FRESH_RANKS``)."""
    if fresh():
        return None
    worlds = SessionWorlds()
    _session["serving"] = serving(worlds)
    _session["serving"].__enter__()
    _session["worlds"] = worlds
    return worlds


def finish(folder: pathlib.Path) -> None:
    worlds = _session.pop("worlds", None)
    if worlds is None:
        return
    _session.pop("serving").__exit__(None, None, None)
    worlds.close()
    with open(folder / "tasks.jsonl", "a") as f:
        for record in worlds.log:
            f.write(json.dumps(record) + "\n")


def worlds() -> Worlds | None:
    """The session's worlds, or None where every launch starts fresh ranks."""
    return _session.get("worlds")


@contextlib.contextmanager
def launches_for(item):
    """Around a test marked ``real_launch`` (its fixtures included): its launches start ranks
    of their own."""
    if item.get_closest_marker(MARKER) is None or worlds() is None:
        yield
        return
    previous, launch.shared_worlds = launch.shared_worlds, None
    try:
        yield
    finally:
        launch.shared_worlds = previous
