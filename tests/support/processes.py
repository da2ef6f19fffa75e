"""Which processes a test session starts, for the time breakdown printed after every run.

Every Python process of the session writes one line to a JSON-lines log when it starts and one
when it ends: the test running when it was started (pytest's ``PYTEST_CURRENT_TEST``, which
children inherit), how it was started (``exec`` for a new interpreter, ``fork``), and at the end
its CPU seconds and whether it was a rank (``RANK`` set, or a rank's process name). A process killed by a signal writes no
end line; it is still counted. New interpreters load ``startup/sitecustomize.py``, which calls
``install``; the pytest process calls it from conftest.py; forks are caught by
``os.register_at_fork``.

The log is ``TWINSHARD_PROCESS_LOG``; without it nothing is written. ``read`` turns a log into
one record per process for ``breakdown.py``.
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import sys
import time

LOG_ENV = "TWINSHARD_PROCESS_LOG"
STARTUP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "startup")

_installed = False


def _write(record: dict) -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    try:  # one write of one line, opened for appending: lines of processes never interleave
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass  # accounting never fails a process


def _started(how: str) -> None:
    _write(
        {
            "event": "start",
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "how": how,
            "test": os.environ.get("PYTEST_CURRENT_TEST", "").rpartition(" ")[0],
            "argv": " ".join(sys.argv[:3])[:200],
            "time": time.time(),
        }
    )


_ended_pid = None


def _ended(*_args) -> None:
    global _ended_pid
    if _ended_pid == os.getpid():
        return
    _ended_pid = os.getpid()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _write(
        {
            "event": "end",
            "pid": os.getpid(),
            "cpu": round(usage.ru_utime + usage.ru_stime, 3),
            "rank": "RANK" in os.environ or "rank" in _process_name(),
            "test": os.environ.get("PYTEST_CURRENT_TEST", "").rpartition(" ")[0],
            "time": time.time(),
        }
    )


def _process_name() -> str:
    """multiprocessing's name for this process (``twinshard-rank1``, ``twinshard-world2-rank0``:
    a shared world's rank, whose environment holds ``RANK`` only while it runs a task)."""
    module = sys.modules.get("multiprocessing")
    return module.current_process().name if module else ""


def _patch_exit() -> None:
    """``os._exit`` skips atexit; the ranks leave through it (``fresh_process.leave``)."""
    real = os._exit
    if getattr(real, "_twinshard_accounted", False):
        return

    def _exit(status):
        _ended()
        real(status)

    _exit._twinshard_accounted = True
    os._exit = _exit


def _after_fork() -> None:
    global _ended_pid
    _ended_pid = None
    _started("fork")


def install(how: str = "exec") -> None:
    """Log this process's start now, its end at exit, and every fork of it."""
    global _installed
    if _installed or not os.environ.get(LOG_ENV):
        return
    _installed = True
    _started(how)
    atexit.register(_ended)
    _patch_exit()
    os.register_at_fork(after_in_child=_after_fork)


def read(path: str) -> list[dict]:
    """One record per process: the start line's fields with the end line's ``cpu`` and
    ``rank`` (``None`` where the process wrote no end line), and a fork's test from its end
    line."""
    procs: list[dict] = []
    alive: dict[int, dict] = {}  # pid -> its newest start (the kernel reuses pids)
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record["event"] == "start":
                alive[record["pid"]] = {**record, "cpu": None, "rank": None}
                procs.append(alive[record["pid"]])
            elif record["pid"] in alive:
                proc = alive.pop(record["pid"])
                proc.update(cpu=record["cpu"], rank=record["rank"])
                if proc["how"] == "fork" and record.get("test"):
                    # a rank of the fork server takes its caller's environment after the fork
                    # (twinshard.ranks.fork_server): the test that launched it is known at its end
                    proc["test"] = record["test"]
    return procs
