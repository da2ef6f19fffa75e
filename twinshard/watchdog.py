"""The watchdog: a run whose ranks stop making progress is stopped and the stalled rank named.

Every rank keeps a small record of what it is doing: the collective it waits in (or the last
one it left), how many it has issued, and its own words from ``progress("step 12")``. A thread
publishes that record a few times per timeout to a store (the launcher's, or the one
``torchrun`` set up), with a heartbeat counter. A detector reads all the records: when no
rank's record has changed for ``hang_timeout`` seconds, the run has stalled. It names

- the ranks whose heartbeat stopped too (a process stopped with SIGSTOP or a debugger, or
  frozen outside Python): they are the cause;
- else the ranks that are outside any collective while the others wait in one;
- else, when all wait, the ranks that issued fewer collectives than the others,

and says which collective the others wait in. Then every rank's Python stack is dumped with
``faulthandler`` (on ``STACK_SIGNAL``, which needs no cooperation from the stuck thread) and
the run is stopped: by the launcher (``twinshard.launch``, its side in ``supervise.py``), or,
under ``torchrun``, by the ranks themselves (``start_torchrun``).

[Note: how collectives are seen] ``install_hooks`` wraps the collectives of
``torch.distributed`` (and its functional collectives, and ``Work.wait``) in place, and
rebinds every module-level alias of them that an already imported module holds (such as
``_all_gather = dist.all_gather_into_tensor``); modules imported later bind the wrappers. A
wrapper only counts and names the call, so one costs about a microsecond per collective.
A phase without any collective or ``progress`` call that lasts longer than ``hang_timeout``
(writing a huge checkpoint to slow storage) is reported as a stall: raise the timeout for it.
"""

from __future__ import annotations

import faulthandler
import functools
import json
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

__all__ = ["DEFAULT_HANG_TIMEOUT", "Detector", "install_hooks", "progress", "start_torchrun"]

DEFAULT_HANG_TIMEOUT = 300.0  # seconds; a healthy FSDP step makes progress many times a second
STACK_SIGNAL = signal.SIGUSR1  # ranks dump every thread's stack on it (faulthandler)
PREFIX = "twinshard-watchdog/"  # store keys: rank{r} (the record), abort (the verdict)
_C10D = (
    "all_reduce all_gather all_gather_into_tensor all_gather_single reduce_scatter "
    "reduce_scatter_tensor reduce_scatter_single broadcast barrier monitored_barrier "
    "all_to_all all_to_all_single reduce gather scatter send recv broadcast_object_list "
    "all_gather_object gather_object scatter_object_list batch_isend_irecv"
).split()
_FUNCOL = "all_reduce all_gather_tensor reduce_scatter_tensor all_to_all_single broadcast".split()


class _Record:
    """What this rank is doing. Written by the rank's own threads, read by the publisher;
    a torn read only blurs one report, so there is no lock."""

    def __init__(self) -> None:
        self.events = 0  # bumps on entering and leaving a collective, and on progress()
        self.issued = 0  # collectives issued so far
        self.depth = 0  # > 0 while inside a collective
        self.op = ""  # the collective waited in, or the last one
        self.last_async = ""  # the last collective issued with async_op=True
        self.what = "starting"  # the rank's own words, from progress()


_RECORD = _Record()


def progress(what: str) -> None:
    """Say what this rank is doing ("step 12", "saving a checkpoint"); counts as progress."""
    _RECORD.what = what
    _RECORD.events += 1


def _enter(op: str) -> None:
    r = _RECORD
    r.depth += 1
    r.events += 1
    r.op = op


def _leave() -> None:
    _RECORD.depth -= 1
    _RECORD.events += 1


def _tracked(name: str, fn):
    @functools.wraps(fn)
    def collective(*args, **kwargs):
        _RECORD.issued += 1
        op = f"{name} #{_RECORD.issued}"
        if kwargs.get("async_op"):
            _RECORD.last_async = op
        _enter(op)
        try:
            return fn(*args, **kwargs)
        finally:
            _leave()

    collective.__twinshard_watched__ = fn
    return collective


def install_hooks() -> None:
    """Wrap the collectives so that entering and leaving them counts as progress (once)."""
    import torch.distributed._functional_collectives as funcol
    from torch._C._distributed_c10d import Work
    from torch.distributed import distributed_c10d as c10d

    if hasattr(Work.wait, "__twinshard_watched__"):
        return
    wrappers = {}  # id(original) -> wrapper
    for module, names, label in ((c10d, _C10D, ""), (funcol, _FUNCOL, "functional ")):
        for name in names:
            original = getattr(module, name, None)
            if callable(original) and not hasattr(original, "__twinshard_watched__"):
                wrappers[id(original)] = (original, _tracked(label + name, original))
    for module in list(sys.modules.values()):  # rebind aliases, dist.* included
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for key, value in list(namespace.items()):
            found = wrappers.get(id(value))
            if found is not None and found[0] is value:
                namespace[key] = found[1]
    wait = Work.wait

    @functools.wraps(wait)
    def watched_wait(self, *args, **kwargs):
        # Inside a blocking collective the wait is that collective's own: keep its name.
        op = _RECORD.op if _RECORD.depth else f"wait for {_RECORD.last_async or 'a collective'}"
        _enter(op)
        try:
            return wait(self, *args, **kwargs)
        finally:
            _leave()

    watched_wait.__twinshard_watched__ = wait
    Work.wait = watched_wait


# ------------------------------------------------------------------------ the rank's side
class _Publisher(threading.Thread):
    """Writes this rank's record to the store every ``interval`` seconds, with a heartbeat."""

    def __init__(self, store, rank: int, interval: float, on_abort=None):
        super().__init__(name="twinshard-watchdog-publisher", daemon=True)
        self.store, self.rank, self.interval, self.on_abort = store, rank, interval, on_abort
        self.beat = 0

    def run(self) -> None:
        host, pid = socket.gethostname(), os.getpid()
        while True:
            r, self.beat = _RECORD, self.beat + 1
            record = dict(
                events=r.events,
                issued=r.issued,
                inside=r.depth > 0,
                op=r.op,
                what=r.what,
                beat=self.beat,
                pid=pid,
                host=host,
            )
            try:
                self.store.set(f"rank{self.rank}", json.dumps(record))
                if self.on_abort and self.store.check(["abort"]):
                    self.on_abort(self.store.get("abort").decode())
            except Exception:  # the store is gone: the run is over, or will be soon
                pass
            time.sleep(self.interval)


def publish_interval(hang_timeout: float) -> float:
    return min(1.0, max(0.05, hang_timeout / 10))


def start_rank(store, rank: int, hang_timeout: float, stack_file=None, on_abort=None) -> None:
    """Watch this rank: hooks, a stack dump on ``STACK_SIGNAL``, the publisher thread."""
    install_hooks()
    faulthandler.register(STACK_SIGNAL, file=stack_file or sys.stderr, all_threads=True)
    _Publisher(store, rank, publish_interval(hang_timeout), on_abort).start()


# ------------------------------------------------------------------------------ detecting
class Detector:
    """Reads every rank's record; ``check()`` returns a ``Stall`` once none has changed for
    ``hang_timeout`` seconds (measured on this process's clock, so hosts need not agree).
    The clock starts when every rank has reported once."""

    def __init__(self, store, world: int, hang_timeout: float, process_state=None):
        self.store, self.world, self.hang_timeout = store, world, hang_timeout
        self.process_state = process_state or (lambda rank, record: None)
        self.silent_after = max(2.0, 3 * publish_interval(hang_timeout))
        now = time.monotonic()
        self.records: dict[int, dict] = {}
        self.beat_seen = dict.fromkeys(range(world), now)  # when each heartbeat last moved
        self.last_progress = now

    def _read(self) -> dict[int, dict]:
        found = {}
        for rank in range(self.world):
            key = f"rank{rank}"
            if rank in self.records or self.store.check([key]):
                found[rank] = json.loads(self.store.get(key))
        return found

    def check(self) -> Stall | None:
        now, records = time.monotonic(), self._read()
        for rank, rec in records.items():
            old = self.records.get(rank)
            if old is None or (old["events"], old["what"]) != (rec["events"], rec["what"]):
                self.last_progress = now
            if old is None or old["beat"] != rec["beat"]:
                self.beat_seen[rank] = now
        self.records = records
        if len(records) < self.world:  # still starting: the launcher's start-up limit applies
            self.last_progress = now
        stalled_for = now - self.last_progress
        if stalled_for < self.hang_timeout:
            return None
        silent = {r for r in range(self.world) if now - self.beat_seen[r] > self.silent_after}
        return Stall(self, stalled_for, silent)


class Stall:
    """A verdict: who stalled, what every rank is doing, and one line that says it."""

    def __init__(self, detector: Detector, seconds: float, silent: set[int]):
        records, world = detector.records, detector.world
        self.lines = {}
        for rank in range(world):
            rec = records[rank]
            state = detector.process_state(rank, rec)
            where = f"{rec['what']}, after {rec['op']}" if rec["op"] else rec["what"]
            if rank in silent:
                how = state or "not responding (stopped, or frozen outside Python)"
                self.lines[rank] = f"{how}; its last report: {where}"
            elif rec["inside"]:
                self.lines[rank] = f"waits in {rec['op']} ({rec['what']})"
            else:
                self.lines[rank] = f"running outside any collective ({where})"
        waiting = {r for r in records if records[r]["inside"] and r not in silent}
        if silent:
            stalled = silent
        elif waiting and len(waiting) < world:
            stalled = set(range(world)) - waiting
        else:  # all wait: those behind the others are the likely cause
            fewest = min(records[r]["issued"] for r in records)
            stalled = {r for r in records if records[r]["issued"] == fewest}
            if len(stalled) == world:
                stalled = set(range(world))
        self.ranks = sorted(stalled)
        ops = sorted({records[r]["op"] for r in waiting - stalled})
        self.headline = (
            f"no rank made progress for {seconds:.0f}s (hang timeout "
            f"{detector.hang_timeout:g}s): rank(s) {', '.join(map(str, self.ranks))} stalled ("
            + "; ".join(f"rank {r}: {self.lines[r]}" for r in self.ranks)
            + ")"
            + (f"; the others wait in {', '.join(ops)}" if ops else "")
        )


# ------------------------------------------------------------------------------ torchrun
def start_torchrun(hang_timeout: float) -> None:
    """Watch this rank of a ``torchrun`` job: publish its record and, on two ranks, detect.

    A stall is written to the store; every rank that still runs dumps its stack to stderr
    and exits with status 1, and ``torchrun`` then stops the job. Uses a client of its own to
    ``MASTER_ADDR:MASTER_PORT``, so a short timeout never touches the process group's store.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=max(10.0, hang_timeout)),
    )
    store = dist.PrefixStore(f"{PREFIX}{attempt}/", client)

    def abort(message: str) -> None:
        sys.stderr.write(f"twinshard watchdog: rank {rank} stops; stack:\n")
        faulthandler.dump_traceback(sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(1)

    start_rank(store, rank, hang_timeout, on_abort=abort)
    if rank in {0, world - 1}:  # two detectors: one of them is not the stopped rank
        threading.Thread(
            target=_detect_forever,
            args=(store, world, hang_timeout),
            name="twinshard-watchdog-detector",
            daemon=True,
        ).start()


def _detect_forever(store, world: int, hang_timeout: float) -> None:
    detector = Detector(store, world, hang_timeout)
    while True:
        time.sleep(publish_interval(hang_timeout))
        try:
            stall = detector.check()
        except Exception:
            continue
        if stall is not None:
            if store.add("verdicts", 1) == 1:  # the first detector speaks for the run
                sys.stderr.write(f"twinshard watchdog: {stall.headline}\n")
                sys.stderr.flush()
                store.set("abort", stall.headline)
            return
