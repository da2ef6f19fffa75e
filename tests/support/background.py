"""Session fixtures that run in a process of their own, started in the background as soon as
the session knows it will need them, so that the core the rank worlds leave idle works on them.

A test module registers such a fixture with ``register(name, command)``: ``command()``
returns the argument list of a process whose standard output is the fixture's raw result.
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
    command: Callable[[], list[str]]
    env: dict = field(default_factory=dict)
    limit: float = 1800.0
    process: subprocess.Popen | None = None
    output: object = None  # the file its output goes to


_jobs: dict[str, Job] = {}


def register(name: str, command: Callable[[], list[str]], env: dict | None = None) -> None:
    """A fixture named ``name`` whose value is the output of ``command()``'s process."""
    _jobs.setdefault(name, Job(command, dict(env or {})))


def registered() -> set[str]:
    return set(_jobs)


def start(name: str) -> None:
    job = _jobs[name]
    if job.process is not None:
        return
    env = {**os.environ, **job.env}
    env.pop("COVERAGE_PROCESS_CONFIG", None)  # none of them runs optimized/ for the report
    job.output = tempfile.TemporaryFile("w+")
    job.process = subprocess.Popen(
        job.command(), stdout=job.output, stderr=subprocess.STDOUT, env=env, text=True
    )


def start_needed(items) -> list:
    """Start the jobs that ``items`` ask for; return those items (to be run last)."""
    wanted = [n for n in _jobs if any(n in getattr(i, "fixturenames", ()) for i in items)]
    for name in wanted:
        start(name)
    return [i for i in items if any(n in getattr(i, "fixturenames", ()) for n in wanted)]


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
