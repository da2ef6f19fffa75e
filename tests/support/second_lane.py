"""A second lane: some test files run in a pytest process of their own, at a lower priority,
beside the session, on whatever CPU the session leaves idle; their results are reported by the
session as if it had run them.

Why: once the site's build is done, the session's own tests keep about 1.3 of CI's 2 cores
busy (many wait on ranks, subprocesses, timeouts), and its order is serial. The files of
``FILES`` start their own commands and ranks and share no session fixture with the rest, so
they can run anywhere. Their process is ``nice``-d by ``NICENESS``: when the session's ranks
want both cores, the lane gets a small share and slows them little; when they do not, the
lane takes the idle core. Two equal lanes were tried before and were slower: torchrun's ranks
beside the other lane's took five times as long, and the site's notebooks ran past their
limits.

How: after collection ``split`` takes the selected tests of ``FILES`` out of the session.
``start_when`` starts ``python -m pytest`` on them, with the session's tier, once the
session's background jobs are done (beside the site's build the lane delayed the notebooks
into the suite's runs); coverage follows, since ``coverage run`` patches subprocesses. In the
lane, ``Reporter`` writes every test report to a JSON-lines file as it comes. When the
session's own tests are done, ``join`` waits for the lane, then hands each report to the
session's hooks (terminal, JUnit, the time accounting, the exit status), as pytest-xdist does
with its workers' reports; a test the lane never reported fails with the end of the lane's
output. ``TWINSHARD_ONE_LANE=1`` runs everything in the
session, in one lane.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from _pytest.reports import TestReport

ONE_LANE_ENV = "TWINSHARD_ONE_LANE"
REPORTS_ENV = "TWINSHARD_LANE_REPORTS"  # set in the lane: where its reports go
ITEMS_ENV = "TWINSHARD_LANE_ITEMS"  # set in the lane: the file of the node ids it runs
NICENESS = 10  # the lane's weight is a tenth of the session's when both want a core
# Test files that start their own processes and ranks and read no fixture the session builds
# once for others (the site, the suite's runs, the fake accelerator's run, the short training
# run): the measuring commands, and every command taking a module from outside.
FILES = (
    "tests/measuring/test_bench.py",
    "tests/measuring/test_collective_groups.py",
    "tests/measuring/test_floors.py",
    "tests/measuring/test_fresh_process.py",
    "tests/measuring/test_plan.py",
    "tests/measuring/test_plan_ideal.py",
    "tests/measuring/test_plan_measured.py",
    "tests/measuring/test_plan_search.py",
    "tests/measuring/test_schedule.py",
    "tests/measuring/test_schedule_memory.py",
    "tests/structure/test_outside_impl.py",
)

_lane: dict = {}  # the running lane: process, items, folder, log, started


def in_lane() -> bool:
    """Whether this process is a second lane (started by ``split``)."""
    return REPORTS_ENV in os.environ or "reports" in _lane


def configure(config) -> None:
    """In a lane: report every test to the lane's file, and take the lane's variables out of
    the environment (a pytest started by one of its tests is a session of its own)."""
    reports = os.environ.pop(REPORTS_ENV, None)
    items = os.environ.pop(ITEMS_ENV, None)
    if reports is None:
        return
    _lane.update(reports=reports, items=set(pathlib.Path(items).read_text().splitlines()))
    config.pluginmanager.register(Reporter(config, reports), "twinshard-second-lane")


def keep_mine(items: list) -> None:
    """In a lane: run exactly the tests the session sent."""
    if "items" in _lane:
        items[:] = [item for item in items if item.nodeid in _lane["items"]]


class Reporter:
    """The lane's side: each report, serialized as pytest-xdist does, one line each."""

    def __init__(self, config, path: str):
        self.config = config
        self.path = path

    def pytest_runtest_logreport(self, report) -> None:
        data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
        with open(self.path, "a") as f:
            f.write(json.dumps(data) + "\n")


def split(config, items: list, folder: pathlib.Path) -> None:
    """In the session: take the selected tests of ``FILES`` out of ``items``, for a lane that
    ``start_when`` starts; nothing where every selected test is in one lane or the other, or where
    ``TWINSHARD_ONE_LANE`` is set."""
    if in_lane() or os.environ.get(ONE_LANE_ENV, "0") not in ("", "0"):
        return
    root = pathlib.Path(str(config.rootpath))
    mine = [i for i in items if i.nodeid.partition("::")[0] in FILES]
    if not mine or len(mine) == len(items):
        return
    folder.mkdir(parents=True, exist_ok=True)
    reports, listed, log = (folder / f"lane.{n}" for n in ("reports.jsonl", "items", "log"))
    reports.unlink(missing_ok=True)
    listed.write_text("\n".join(i.nodeid for i in mine) + "\n")
    files = sorted({i.nodeid.partition("::")[0] for i in mine})
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    command += [f"--junitxml={folder / 'lane.junit.xml'}"]  # the session's has every test
    command += ["--full"] if config.getoption("--full") else []
    env = {**os.environ, REPORTS_ENV: str(reports), ITEMS_ENV: str(listed)}
    _lane.update(command=[*command, *files], cwd=root, env=env, process=None, mine=mine)
    _lane.update(files=files, reports_path=reports, log=log)
    items[:] = [i for i in items if i not in mine]


def count(session) -> None:
    """In the session, before its tests run: count the lane's tests among them (for the
    terminal's progress)."""
    if "mine" in _lane:
        session.testscollected += len(_lane["mine"])


def start_when(idle: bool) -> None:
    """Start the lane once ``idle``: conftest.py calls this after each test with whether the
    session's background jobs (the site's build and its notebooks) are done. Started beside
    them, the lane delayed the notebooks into the suite's runs, which then took 20% longer."""
    if not idle or "command" not in _lane or _lane.get("process") is not None:
        return
    output = open(_lane["log"], "w")
    _lane["process"] = subprocess.Popen(
        _lane["command"],
        cwd=_lane["cwd"],
        env=_lane["env"],
        stdout=output,
        stderr=subprocess.STDOUT,
        # A process group of its own, so that its ranks and commands are stopped with it, in
        # the session's session: Linux's autogroups share the CPU fairly between sessions
        # and apply nice only within one, so a new session would take half the CPU, niced or
        # not (measured: 0.48 of two cores against 0.08 in the same session).
        process_group=0,
        preexec_fn=lambda: os.nice(NICENESS),
    )
    _lane["output"] = output
    _lane["started"] = time.time()


def join(session, limit: float) -> None:
    """In the session, once its own tests ran: wait up to ``limit`` seconds for the lane, then
    report its tests through the session's hooks."""
    start_when(True)
    process = _lane.get("process")
    if process is None:
        return
    waited = time.monotonic()
    try:
        process.wait(timeout=max(limit, 1))
    except subprocess.TimeoutExpired:
        stop()
    _lane["output"].close()
    _lane["waited"] = time.monotonic() - waited
    hook = session.config.hook
    path = _lane["reports_path"]
    ended = path.stat().st_mtime if path.exists() else time.time()  # its last report
    _lane["took"] = ended - _lane["started"]
    lines = path.read_text().splitlines() if path.exists() else []
    reported: dict[str, str] = {}  # nodeid -> the last phase reported
    for line in lines:
        report = hook.pytest_report_from_serializable(config=session.config, data=json.loads(line))
        if report.nodeid not in reported:
            hook.pytest_runtest_logstart(nodeid=report.nodeid, location=report.location)
        hook.pytest_runtest_logreport(report=report)
        reported[report.nodeid] = report.when
        if report.when == "teardown":
            hook.pytest_runtest_logfinish(nodeid=report.nodeid, location=report.location)
    tail = _lane["log"].read_text(errors="replace")[-4000:] if _lane["log"].exists() else ""
    for item in _lane["mine"]:
        if reported.get(item.nodeid) == "teardown":
            continue
        why = (
            f"the second lane (tests/support/second_lane.py) ended with exit code "
            f"{process.returncode} before this test's end was reported; the end of its output "
            f"({_lane['log']}):\n{tail}"
        )
        if item.nodeid not in reported:
            hook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        when = "teardown" if reported.get(item.nodeid) == "call" else "call"
        report = TestReport(item.nodeid, item.location, {}, "failed", why, when)
        hook.pytest_runtest_logreport(report=report)
        hook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    _lane["process"] = None


def summary() -> str | None:
    """One line on the lane for the end of the session's output (None without a lane)."""
    if "took" not in _lane:
        return None
    return (
        f"second lane: {len(_lane['mine'])} tests of {len(_lane['files'])} files at nice {NICENESS}, "
        f"its last report {_lane['took']:.0f} s after it started; the session waited "
        f"{_lane['waited']:.0f} s for it at its end"
    )


def stop() -> None:
    """Stop the lane and everything it started (the session ends without it)."""
    process = _lane.get("process")
    if process is None or process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
