"""The launcher's side of a run: wait for the ranks' reports, act on a stall or a signal, stop.

``twinshard.ranks.launch`` starts the ranks and then hands them to ``collect``, which waits on every
rank's pipe and process sentinel at once, so it wakes as soon as a rank reports or dies. It
never joins a process that may still be writing, and reads a result of any size while it is
written. When a rank raises or dies, it waits a moment for its peers' reports, then raises
``LaunchError`` naming the rank; peers that failed only because it vanished ("connection
closed by peer") are listed after it. The caller then ``stop``s every rank (SIGTERM, then
SIGKILL), since they may be blocked in a collective that will never finish.

With a watchdog (``Watch``), a stall (see ``twinshard.ranks.watchdog``) makes every rank dump its
Python stack, a stopped rank included (it is continued for that), and ends in ``HangError``.
With ``forward_signals``, SIGINT and SIGTERM to this process are passed on to the ranks,
which decide how to stop; a second one stops them at once (``KeyboardInterrupt``).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import threading
import time
import warnings
from multiprocessing.connection import wait

from . import watchdog

_STARTUP_MARGIN = 60.0  # extra seconds for the ranks to start and join the group
STARTUP_ENV = "TWINSHARD_STARTUP_LIMIT"  # the most seconds ranks get to start; default 120


def startup_limit() -> float:
    """The most seconds that ranks get to start (import torch, join their group), whatever the
    function's own deadline: a rank that cannot start is named within it."""
    return float(os.environ.get(STARTUP_ENV, "") or 120.0)


_EXIT_GRACE = 10.0  # how long a rank that has reported gets to exit by itself
_KILL_GRACE = 2.0  # how long to wait after SIGTERM before SIGKILL
_POLL = 0.5  # the longest the parent sleeps between checks
_DRAIN = 1.0  # after a failure, how long to wait for the other ranks' reports
_STACK_WAIT = 3.0  # how long the ranks get to write their stacks after a stall
# First lines of errors that a rank gets because a peer died, not because of its own bug.
_KNOCK_ON = (
    "closed by peer",
    "reset by peer",
    "broken pipe",
    "remote worker",
    "connection refused",
)


class LaunchError(RuntimeError):
    """A rank raised, died or missed the deadline. ``ranks``: the ranks that failed
    first (the likely cause); ``failures``: every failed rank -> what happened; ``raised``: the
    ranks among them that reported an exception."""

    def __init__(
        self, message: str, ranks: list[int], failures: dict[int, str], raised=frozenset()
    ):
        super().__init__(message)
        self.ranks = list(ranks)
        self.failures = dict(failures)
        self.raised = frozenset(raised)


class HangError(LaunchError):
    """No rank made progress for the hang timeout. ``ranks``: the stalled ranks; ``headline``:
    the one-line verdict; ``failures``: every rank's state and Python stack."""

    def __init__(self, headline: str, ranks: list[int], failures: dict[int, str]):
        body = "".join(f"\n\n--- rank {r} ---\n{text}" for r, text in sorted(failures.items()))
        super().__init__(headline + body, ranks, failures)
        self.headline = headline


def stop(procs: list, gently: bool = True) -> None:
    """Terminate every live process, then kill what is left (``gently=False``: kill at once,
    for ranks that take SIGTERM as a request to finish their step)."""
    for how in ("terminate", "kill") if gently else ("kill",):
        live = [p for p in procs if p.is_alive()]
        for p in live:
            getattr(p, how)()
        end = time.monotonic() + _KILL_GRACE
        for p in live:
            p.join(max(0.0, end - time.monotonic()))


def error(headline: str, failures: dict[int, str], raised=frozenset()) -> LaunchError:
    """``LaunchError`` with ``headline``, the ranks that failed first, then those that probably
    failed as a consequence (a peer's connection closed), each with what it reported."""

    def knock_on(text: str) -> bool:
        return any(k in text.split("\n", 1)[0].lower() for k in _KNOCK_ON)

    first = [r for r, text in failures.items() if not knock_on(text)] or list(failures)
    later = [r for r in failures if r not in first]
    message = f"{headline}: rank(s) {', '.join(map(str, first))}"
    if later:
        message += f"; then rank(s) {', '.join(map(str, later))}, probably as a consequence"
    message += "".join(f"\n\n--- rank {r} ---\n{failures[r]}" for r in first + later)
    return LaunchError(message, first, failures, raised)


def process_state(pid: int) -> str | None:
    """ "stopped" when the kernel says the process is stopped (Linux), else None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return "stopped (SIGSTOP, or a debugger)" if state in ("T", "t") else None


class Watch:
    """The launcher's watchdog: a ``watchdog.Detector`` over the ranks' records, and the
    stack dumps (each rank writes its own file in ``stack_dir`` on ``STACK_SIGNAL``)."""

    def __init__(self, store, procs: list, hang_timeout: float, stack_dir: str):
        self.procs, self.stack_dir, self.hang_timeout = procs, stack_dir, hang_timeout
        self.detector = watchdog.Detector(
            store, len(procs), hang_timeout, lambda rank, _: process_state(procs[rank].pid)
        )

    def close(self) -> None:
        """Let go of the store, so that its server can end with the run."""
        self.detector.store = None

    def check(self) -> None:
        stall = self.detector.check()
        if stall is not None:
            raise HangError(stall.headline, stall.ranks, self._stacks(stall.lines))

    def _stacks(self, lines: dict[int, str]) -> dict[int, str]:
        """Every rank's stack. The running ranks dump theirs and are killed; only then are
        stopped ones continued to dump theirs, so that none can take another step."""
        files = {r: os.path.join(self.stack_dir, f"rank{r}.txt") for r in range(len(self.procs))}
        live = [r for r, p in enumerate(self.procs) if p.is_alive()]
        stopped = [r for r in live if process_state(self.procs[r].pid) is not None]
        for group in ([r for r in live if r not in stopped], stopped):
            for r in group:
                with contextlib.suppress(OSError):
                    os.kill(self.procs[r].pid, watchdog.STACK_SIGNAL)
                    if r in stopped:  # the signal waits until the process runs again
                        os.kill(self.procs[r].pid, signal.SIGCONT)
            end = time.monotonic() + _STACK_WAIT
            while time.monotonic() < end and not all(_size(files[r]) for r in group):
                time.sleep(0.05)
            time.sleep(0.1)  # let the last lines land
            stop([self.procs[r] for r in group], gently=False)
        stacks = {}
        for rank, path in files.items():
            try:
                with open(path) as f:
                    text = f.read().strip()
            except OSError:
                text = ""
            stacks[rank] = f"{lines[rank]}\n\n{text or '(no stack: the rank did not answer)'}"
        return stacks


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


@contextlib.contextmanager
def forwarding(procs: list, enabled: bool):
    """While active, SIGINT and SIGTERM are passed on to the ranks; a second one raises
    ``KeyboardInterrupt`` here (the caller then stops the ranks)."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []

    def handler(signum, frame):
        received.append(signum)
        if len(received) > 1:
            raise KeyboardInterrupt
        for p in procs:
            if p.is_alive():
                with contextlib.suppress(OSError):
                    os.kill(p.pid, signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def collect(procs: list, conns: list, timeout: float, watch: Watch | None = None) -> list:
    """Read every rank's reports until all have returned, one fails or time runs out; then let
    the ranks exit."""
    results = await_results(procs, conns, timeout, watch)
    end = time.monotonic() + _EXIT_GRACE  # all returned: let them tear down and exit
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    if stuck := [r for r, p in enumerate(procs) if p.is_alive()]:
        warnings.warn(
            f"rank(s) {stuck} returned but did not exit within {_EXIT_GRACE}s; killing them",
            stacklevel=3,
        )
    bad = {
        r: f"returned a result but then exited with code {p.exitcode}"
        for r, p in enumerate(procs)
        if p.exitcode not in (0, None)
    }
    if bad:
        raise error("launch failed during teardown", bad)
    return results


def await_results(
    procs: list,
    conns: list,
    timeout: float,
    watch: Watch | None = None,
    startup: float | None = None,
    task: str | None = None,
) -> list:
    """Each rank's result, once every rank has reported "ready" (joined its group) and then
    its result; ``LaunchError`` as soon as one raises or dies, or when time runs out:
    ``startup`` seconds to get ready (default: ``timeout`` or the watchdog's, plus a margin,
    at most ``startup_limit()``),
    then ``timeout`` for the function. ``task`` names what the ranks run in the error's first
    line (``twinshard.ranks.worlds``: ranks that run many tasks)."""
    n, ready, results, failures, raised = len(procs), set(), {}, {}, set()
    prefix = "" if task is None else f"task {task}: "

    def poll(rank: int) -> None:
        conn, proc = conns[rank], procs[rank]
        while rank not in results and rank not in failures:
            if not conn.poll():
                if proc.exitcode is not None and not conn.poll():  # died without a report
                    failures[rank] = (
                        f"exited without reporting a result (exit code {proc.exitcode})"
                    )
                return
            try:
                msg = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                proc.join(_KILL_GRACE)
                failures[rank] = f"exited without reporting a result (exit code {proc.exitcode})"
            except Exception as e:
                failures[rank] = f"its result could not be unpickled: {type(e).__name__}: {e}"
            else:
                if msg[0] == "ready":
                    ready.add(rank)
                elif msg[0] == "ok":
                    results[rank] = msg[1]
                else:
                    failures[rank] = f"{msg[1]}: {msg[2]}\n\n{msg[3].rstrip()}"
                    raised.add(rank)

    def wait_and_poll(until: float) -> list[int]:
        pending = [r for r in range(n) if r not in results and r not in failures]
        wait(
            [conns[r] for r in pending] + [procs[r].sentinel for r in pending],
            timeout=max(0.0, min(_POLL, until - time.monotonic())),
        )
        for r in pending:
            poll(r)
        return [r for r in pending if r not in results and r not in failures]

    # With a watchdog, starting up may take its timeout (plus the margin), not fn's deadline.
    if startup is None:
        startup = min(timeout, watch.hang_timeout if watch else timeout) + _STARTUP_MARGIN
        startup = min(startup, startup_limit())
    deadline, all_ready = time.monotonic() + startup, False
    while not failures and (pending := wait_and_poll(deadline)):
        if not all_ready and len(ready) == n:
            all_ready, deadline = True, time.monotonic() + timeout + min(5.0, 0.1 * timeout)
        if time.monotonic() >= deadline and not failures:
            late = {
                r: "had not finished " + ("fn" if r in ready else "starting up") for r in pending
            }
            what = f"deadline of {timeout}s" if all_ready else f"start-up limit of {startup:g}s"
            raise error(f"{prefix}{what} exceeded", late)
        if watch is not None and not failures and all_ready:  # start-up has its own limit
            watch.check()
    if failures:  # peers of a failed rank often fail a moment later: collect them briefly
        end = time.monotonic() + _DRAIN
        while wait_and_poll(end) and time.monotonic() < end:
            pass
        headline = "launch failed" if task is None else f"task {task} failed"
        raise error(headline, failures, raised)

    return [results[r] for r in range(n)]
