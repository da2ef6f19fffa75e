"""Session fixtures that run in a process of their own, started in the background as soon as
the session knows it will need them, so that the core the rank worlds leave idle works on them.

A test module registers such a fixture with ``register(name, command)``: ``command(items)``
returns the argument list of a process whose standard output is the fixture's raw result, for
the collected tests ``items`` that ask for it (so that it computes what they need).
When collection is done, conftest.py starts every registered job that a collected test asks
for (``start_needed``) and runs the tests that ask for one after the others; the fixture then
calls ``result(name)``, which waits for the process and returns its output (or fails the
test with the end of its output). Each job runs once per session.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Job:
    command: Callable[[list], list[str]]
    env: dict = field(default_factory=dict)
    limit: float = 1800.0
    process: subprocess.Popen | None = None
    output: object = None  # the file its output goes to


_jobs: dict[str, Job] = {}


def register(name: str, command: Callable[[list], list[str]], env: dict | None = None) -> None:
    """A fixture named ``name`` whose value is the output of ``command(items)``'s process."""
    _jobs.setdefault(name, Job(command, dict(env or {})))


def registered() -> set[str]:
    return set(_jobs)


def start(name: str, items: list = ()) -> None:
    """Start job ``name`` for the tests ``items`` (none: every test that may ask for it)."""
    job = _jobs[name]
    if job.process is not None:
        return
    env = {**os.environ, **job.env}
    env.pop("COVERAGE_PROCESS_CONFIG", None)  # none of them runs optimized/ for the report
    job.output = tempfile.TemporaryFile("w+")
    job.process = subprocess.Popen(
        job.command(list(items)), stdout=job.output, stderr=subprocess.STDOUT, env=env, text=True
    )


def start_needed(items) -> list:
    """Start the jobs that ``items`` ask for; return those items (to be run last)."""
    asking = {n: [i for i in items if n in getattr(i, "fixturenames", ())] for n in _jobs}
    for name, those in asking.items():
        if those:
            start(name, those)
    return [i for i in items if any(i in those for those in asking.values())]


def running() -> bool:
    """Whether a job that was started is still running."""
    return any(job.process is not None and job.process.poll() is None for job in _jobs.values())


def result(name: str) -> tuple[int, str]:
    """The job's exit status and output (started now if nobody started it)."""
    job = _jobs[name]
    start(name)
    try:
        job.process.wait(timeout=job.limit)
    except subprocess.TimeoutExpired:
        job.process.kill()
        job.process.wait()
    job.output.seek(0)
    return job.process.returncode, job.output.read()


def stop_all() -> None:
    """Stop the jobs still running (the session ends before their tests ran)."""
    for job in _jobs.values():
        if job.process is not None and job.process.poll() is None:
            job.process.kill()
            job.process.wait()
