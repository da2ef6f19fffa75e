"""A rank of a shared world (``twinshard.ranks.worlds``): its life, one task after another.

``rank_main`` starts the rank: it takes its coverage collector (where ``coverage run`` started
one), connects to the world's store, imports what nearly every task imports (``PRELOADED``) and
takes the ``Snapshot`` of a fresh rank. Then it waits for messages from the world's process:

- a task: ``run_task`` enters it (the caller's environment, directory and ``sys.path``, the
  generators restarted, coverage on or off as asked), joins a fresh default process group on a
  store prefix of the task's own, reports "ready", runs the function, reports its result, meets
  the other ranks at a barrier, destroys the group, puts the rank back (``rank_reset``) and
  reports "idle" with what it put back and the CPU seconds the task took;
- "recover", after its task raised on every rank: the group is dropped without a collective
  and the rank put back;
- "close", or the world's process gone: the rank saves what coverage measured and leaves.

A rank whose task raised while others did not is stopped by the world's process: it may be
blocked in a collective that will never finish.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import signal
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from . import devices, fresh_process, launch
from .rank_reset import PRELOADED, Snapshot

STORE_PREFIX = "twinshard-task"


def _send(conn, *msg) -> None:
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _report(conn, e: BaseException) -> None:
    """Tell the world's process that ``e`` was raised here, as far as the pipe still works."""
    kind = f"{type(e).__module__}.{type(e).__qualname__}".removeprefix("builtins.")
    with contextlib.suppress(Exception):
        _send(conn, "error", kind, str(e), traceback.format_exc())


def rank_main(
    rank: int, nprocs: int, port: int, backend: str, conn, parent: int | None, caller=None
) -> None:
    """A rank's life: connect to the store, then run tasks until told to close. ``caller``:
    for a rank forked from the fork server, the state of the process that started the world
    (``twinshard.ranks.fork_server.Caller``)."""
    try:
        fresh_process.begin_as_child(caller, parent)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        torch.set_num_threads(1)
        base = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=300))
        _Coverage.take()
        launch.bind_rank_info(rank, nprocs, backend)
        for name in PRELOADED:  # what nearly every task imports, seen as a fresh process has it
            importlib.import_module(name)
        clean = Snapshot()
        _send(conn, "up")
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        _report(conn, e)
        fresh_process.leave(1)
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            msg = ("close",)
        if msg[0] == "close":
            _Coverage.save()
            fresh_process.leave(0)
        run_task(rank, nprocs, port, backend, base, conn, msg[1], clean)


def run_task(rank, nprocs, port, backend, base, conn, task: dict, clean: Snapshot) -> None:
    cpu = time.process_time()
    try:
        clean.enter(task)
        _Coverage.measure(task["measured"])
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(nprocs),
        )
        threads = int(os.environ.get("TWINSHARD_THREADS", "1") or "0")
        torch.set_num_threads(threads if threads > 0 else clean.threads)
        store = dist.PrefixStore(f"{STORE_PREFIX}/{task['id']}/", base)
        timeout = timedelta(seconds=task["timeout"])
        devices.join_group(
            backend, rank, store=store, rank=rank, world_size=nprocs, timeout=timeout
        )
        _send(conn, "ready")
        fn, args, kwargs = pickle.loads(task["payload"])
        result = fn(*args, **kwargs)
        conn.send_bytes(pickle.dumps(("ok", result), protocol=pickle.HIGHEST_PROTOCOL))
    except BaseException as e:  # noqa: BLE001 - everything is reported to the parent
        _report(conn, e)
        _await_recovery(conn, clean, cpu)  # or leave: peers may be stuck in a collective
        return
    try:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        leaks = clean.restore()
        if task["measured"]:
            _Coverage.save()
        _send(conn, "idle", (leaks, time.process_time() - cpu))
    except BaseException as e:  # noqa: BLE001
        _report(conn, e)
        fresh_process.leave(1)


def _await_recovery(conn, clean: Snapshot, cpu: float) -> None:
    """After this rank's task raised: where every rank raised, the parent asks the ranks to
    recover (drop the task's process group without a collective, put the state back) and the
    world goes on; else it stops them."""
    try:
        msg = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        msg = ("close",)
    if msg[0] != "recover":
        fresh_process.leave(1)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
        _send(conn, "idle", (clean.restore(), time.process_time() - cpu))
    except BaseException as e:  # noqa: BLE001
        _report(conn, e)
        fresh_process.leave(1)


class _Coverage:
    """This rank's coverage collector, where ``coverage`` started one in it (``coverage run``
    with subprocess patching): taken while it runs, since ``Coverage.current()`` forgets it once
    it is paused."""

    collector = None
    measuring = False

    @classmethod
    def take(cls) -> None:
        coverage = sys.modules.get("coverage")
        cls.collector = coverage.Coverage.current() if coverage else None
        cls.measuring = cls.collector is not None

    @classmethod
    def measure(cls, on: bool) -> None:
        """Start or pause the collector for the next task."""
        if cls.collector is None or on == cls.measuring:
            return
        cls.collector.start() if on else cls.collector.stop()
        cls.measuring = on

    @classmethod
    def save(cls) -> None:
        """Write what the tasks measured so far: a world killed later keeps it."""
        if cls.collector is not None:
            cls.collector.save()
