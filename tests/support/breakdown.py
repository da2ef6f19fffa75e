"""Where a test session's time went: per test file, its time, tests, the processes it started
(and how many were ranks, and their CPU seconds), then the slowest tests.

conftest.py prints this after every run from the two logs the session writes under
``build/tests/`` (``tests.jsonl``: one line per test with its outcome and seconds, setup and
teardown included; ``processes.jsonl``: ``processes.py``'s log; ``tasks.jsonl``: the tasks run
in the shared rank worlds, ``shared_worlds.py``). Run it alone to read a kept session again::

    python3 tests/support/breakdown.py build/tests
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict

import processes

OUTSIDE = "(outside any test)"


def read_lines(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def file_of(nodeid: str) -> str:
    return nodeid.partition("::")[0] or OUTSIDE


def table(tests: list[dict], procs: list[dict], tasks: list[dict] = (), slowest: int = 25) -> str:
    """The breakdown as text: the files by time, then the ``slowest`` tests. Columns: seconds
    of the file's tests (setup and teardown included), tests, failed, tasks sent to the shared
    worlds and the CPU seconds their ranks spent on them, processes started (by the file's
    tests) and how many were ranks, and those processes' CPU seconds (a shared world's ranks
    count for the test that started the world)."""
    files: dict[str, dict] = defaultdict(
        lambda: {
            "seconds": 0.0,
            "tests": 0,
            "failed": 0,
            "tasks": 0,
            "task_cpu": 0.0,
            "procs": 0,
            "ranks": 0,
            "cpu": 0.0,
        }
    )
    for t in tests:
        row = files[file_of(t["nodeid"])]
        row["seconds"] += t["seconds"]
        row["tests"] += 1
        row["failed"] += t["outcome"] == "failed"
    for t in tasks:
        files[file_of(t.get("test", ""))]["tasks"] += 1
        files[file_of(t.get("test", ""))]["task_cpu"] += t.get("cpu", 0.0)
    for p in procs:
        if p["how"] == "session":
            continue
        row = files[file_of(p["test"])]
        row["procs"] += 1
        row["ranks"] += bool(p["rank"])
        row["cpu"] += p["cpu"] or 0.0
    total = {k: sum(r[k] for r in files.values()) for k in next(iter(files.values()), {})}

    def line(name: str, r: dict) -> str:
        return (
            f"{name[-48:]:<48} {r['seconds']:>8.1f} {r['tests']:>6} {r['failed']:>6}"
            f" {r['tasks']:>6} {r['task_cpu']:>9.1f} {r['procs']:>6} {r['ranks']:>6}"
            f" {r['cpu']:>11.1f}"
        )

    lines = [
        f"{'file':<48} {'seconds':>8} {'tests':>6} {'failed':>6} {'tasks':>6} {'task cpu':>9}"
        f" {'procs':>6} {'ranks':>6} {'their cpu s':>11}"
    ]
    lines += [line(n, r) for n, r in sorted(files.items(), key=lambda kv: -kv[1]["seconds"])]
    if total:
        lines.append(line("total", total))
    lines += ["", f"the {slowest} slowest tests (seconds, setup and teardown included)"]
    for t in sorted(tests, key=lambda t: -t["seconds"])[:slowest]:
        lines.append(f"{t['seconds']:>8.1f}  {t['nodeid']}")
    return "\n".join(lines)


def from_folder(folder: str) -> str:
    tests_log = os.path.join(folder, "tests.jsonl")
    procs_log = os.path.join(folder, "processes.jsonl")
    tasks_log = os.path.join(folder, "tasks.jsonl")
    tests = read_lines(tests_log) if os.path.exists(tests_log) else []
    procs = processes.read(procs_log) if os.path.exists(procs_log) else []
    tasks = read_lines(tasks_log) if os.path.exists(tasks_log) else []
    return table(tests, procs, tasks)


if __name__ == "__main__":
    print(from_folder(sys.argv[1] if len(sys.argv) > 1 else "build/tests"))
