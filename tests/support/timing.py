"""The test session's own accounting (pytest hooks that conftest.py takes in): each test's
outcome and seconds in ``build/tests/tests.jsonl``, every process started in
``build/tests/processes.jsonl`` (``processes.py``), and the breakdown printed at the end
(``breakdown.py``). Each session starts both logs afresh; ``TWINSHARD_TEST_LOGS`` names
another folder for them."""

from __future__ import annotations

import json
import os
import pathlib
import time

import breakdown
import processes
import second_lane

# TWINSHARD_TEST_LOGS: another folder (a session that runs pytest inside a test keeps its own)
FOLDER = pathlib.Path(
    os.environ.get("TWINSHARD_TEST_LOGS")
    or pathlib.Path(__file__).resolve().parents[2] / "build" / "tests"
)
STARTED = time.monotonic()  # when the session began (conftest.py imports this first)
_seconds: dict[str, float] = {}
_outcome: dict[str, str] = {}


def start() -> None:
    """Fresh logs (a second lane writes to its session's), and every later Python process of
    the session logging itself."""
    FOLDER.mkdir(parents=True, exist_ok=True)
    for name in ("tests.jsonl", "processes.jsonl", "tasks.jsonl"):
        if not second_lane.in_lane():
            (FOLDER / name).unlink(missing_ok=True)
    os.environ[processes.LOG_ENV] = str(FOLDER / "processes.jsonl")
    path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (processes.STARTUP, path) if p)
    processes.install("session")


def pytest_runtest_logreport(report) -> None:
    _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration
    if report.failed or report.nodeid not in _outcome or report.when == "call":
        if not (report.passed and _outcome.get(report.nodeid) == "failed"):
            _outcome[report.nodeid] = report.outcome


def pytest_terminal_summary(terminalreporter) -> None:
    if second_lane.in_lane():  # the session has every test's report
        return
    with open(FOLDER / "tests.jsonl", "w") as f:
        for nodeid, seconds in _seconds.items():
            f.write(
                json.dumps(
                    {"nodeid": nodeid, "outcome": _outcome[nodeid], "seconds": round(seconds, 3)}
                )
                + "\n"
            )
    terminalreporter.write_sep("=", "where the time went (tests/support/breakdown.py)")
    terminalreporter.write_line(breakdown.from_folder(str(FOLDER)))
    if lane := second_lane.summary():
        terminalreporter.write_line(lane)
