"""Worlds of N ranks started once and reused: each runs many tasks, as ``launch`` runs one.

Starting a rank costs more than most of what tests and notebooks run on it: a new interpreter
imports torch (1.4-3.7 CPU seconds on a 2-core machine, paid once per process where ranks fork
from the fork server, ``twinshard.ranks.fork_server``) and joins a process group, and a
two-rank launch that runs nothing cost 2.7 s with spawned ranks. A ``World`` starts its ranks once; ``run(fn,
*args)`` sends ``fn`` to every rank and returns what each returned, ordered by rank, exactly
as ``twinshard.ranks.launch.launch`` does, and raises the same ``LaunchError`` when a rank raises,
dies or runs past the deadline (its first line names the task).

A task sees what a launched rank sees. The rank takes the caller's environment, working
directory and ``sys.path`` as they are when the task is sent (plus ``env``), joins a fresh
default process group (``gloo``) on a store prefix of the task's own, so no key of an earlier
task is read, runs ``fn``, meets the other ranks at a barrier and destroys the group. Then it
puts back what a task may change for the next one (``twinshard.ranks.rank_reset``: the default dtype
and device, grad mode, the switch, module globals a task replaced, dynamo's caches, the
stand-in streams, threads, the environment) and reports what it had to put back; the caller
names the task in a warning (``leaks``). The random generators restart from the state the rank
started with, as in a fresh process. Where a
run with ``coverage`` asked for it (``COVERAGE_PROCESS_CONFIG`` in the caller's environment at
the time), the task is measured, else the rank's collector is paused for it.

A task that raises on every rank leaves its world usable: each rank drops the task's process
group (no collective: the ranks may have stopped at different ones) and puts its state back.
When a task fails on some ranks only, or a rank dies or hangs, every rank is stopped and the
world is marked ``broken``; ``Worlds`` (one world per size) starts a new one for the next task.
A rank that cannot tell its task apart from the next (a device registered for good) also
breaks its world.

``serving(worlds)`` sends every ``launch`` call that a world can serve to ``worlds``: CPU ranks
that would be spawned (a function and arguments that pickle by reference), no watchdog, no
forwarded signals. The rest launch as before; a call that forks keeps forking, since its ranks
must be copies of the caller. The test suite does this for its whole session
(``tests/conftest.py``).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import time
import warnings
from multiprocessing.connection import wait

from . import devices, fork_server, launch, supervise
from .world_rank import rank_main

__all__ = ["World", "Worlds", "serving"]

JOIN_LIMIT = 60.0  # seconds for a task's ranks to join its process group
TEARDOWN_LIMIT = 30.0  # seconds for the barrier after a task and the reset
COVERAGE_ENV = fork_server.COVERAGE_ENV  # set by ``coverage run`` with subprocess patching


class World:
    """``nprocs`` CPU ranks (gloo) that run tasks until ``close``."""

    def __init__(self, nprocs: int, backend: str = "gloo", start_env: dict | None = None):
        """``start_env``: variables the ranks start with beside the caller's environment
        (``Worlds`` passes coverage's, so that a world started while it is paused can still
        measure later tasks)."""
        if devices.backend_device(backend, 0).type != "cpu":
            raise ValueError(f"a World runs host-backend ranks (gloo); got {backend!r}")
        self.nprocs, self.backend = nprocs, backend
        self.broken = False
        self.tasks = 0
        self.last_cpu = 0.0  # CPU seconds the ranks spent on the last task
        self.leaks: list[tuple[str, list[str]]] = []  # (task, what its reset put back)
        listener = launch.listen_for_ranks()
        port = listener.getsockname()[1]
        self.procs, self.conns = [], []
        saved = {k: os.environ.get(k) for k in start_env or {}}
        os.environ.update(start_env or {})  # a fresh process starts with this environment
        ctx, caller = fork_server.fresh()  # [Note: ranks from a fork server]
        parent = None if caller else os.getpid()  # a fork server's child has the server as parent
        for rank in range(nprocs):
            ours, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=rank_main,
                args=(rank, nprocs, port, backend, theirs, parent, caller),
                name=f"twinshard-world{nprocs}-rank{rank}",
            )
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(ours)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
        self.store = launch.serve_store(listener, timeout=3600.0)
        try:
            self._await_all("up", supervise.startup_limit(), "start-up")
        except BaseException:
            self.close()
            raise

    def _await_all(self, what: str, limit: float, phase: str, task: str = "") -> list:
        """The payload of message ``what`` from every rank, within ``limit`` seconds; else
        ``LaunchError`` naming the ranks that did not send it (and the world is closed)."""
        got: dict[int, object] = {}
        deadline = time.monotonic() + limit
        while len(got) < self.nprocs:
            pending = [r for r in range(self.nprocs) if r not in got]
            left = deadline - time.monotonic()
            if left <= 0:
                self.broken = True
                late = {r: f"had not finished its {phase}" for r in pending}
                head = f"task {task}: " if task else ""
                raise supervise.error(f"{head}{phase} limit of {limit:g}s exceeded", late)
            wait([self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending], left)
            for r in pending:
                msg, ended = None, False
                if self.conns[r].poll():
                    try:
                        msg = pickle.loads(self.conns[r].recv_bytes())
                    except (EOFError, OSError):
                        ended = True
                if msg is not None and msg[0] == what:
                    got[r] = msg[1] if len(msg) > 1 else None
                    continue
                head = f"task {task} failed" if task else "a world failed to start"
                if msg is not None and msg[0] == "error":
                    self.broken = True
                    raise supervise.error(head, {r: f"{msg[1]}: {msg[2]}\n\n{msg[3]}"})
                if ended or (msg is None and self.procs[r].exitcode is not None):
                    self.broken = True
                    self.procs[r].join(2.0)
                    code = self.procs[r].exitcode
                    raise supervise.error(head, {r: f"exited during its {phase} (code {code})"})
        return [got[r] for r in range(self.nprocs)]

    def run(self, fn, *args, timeout: float = 300.0, env: dict | None = None, **kwargs) -> list:
        """``fn(*args, **kwargs)`` on every rank; the results by rank (see the module
        docstring). ``LaunchError`` when a rank raises, dies or misses the deadline (then this
        world is ``broken``: closed for good)."""
        if self.broken:
            raise RuntimeError("this world is broken (a task failed in it); start another")
        name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
        self.tasks += 1
        task = {
            "id": f"{os.getpid()}-{id(self)}-{self.tasks}",
            "name": name,
            "payload": pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL),
            "environ": {**os.environ, **{str(k): str(v) for k, v in (env or {}).items()}},
            "cwd": os.getcwd(),
            "path": list(sys.path),
            "measured": COVERAGE_ENV in os.environ,
            "timeout": timeout,
        }
        message = pickle.dumps(("task", task), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(message)
            results = supervise.await_results(
                self.procs, self.conns, timeout, startup=JOIN_LIMIT, task=name
            )
            ends = self._await_all("idle", TEARDOWN_LIMIT, "barrier after the task", name)
        except supervise.LaunchError as error:
            if len(error.raised) < self.nprocs or not self._recover(name):
                self.broken = True
                self.close()
            raise
        except BaseException:
            self.broken = True
            self.close()
            raise
        self.last_cpu = sum(cpu for _, cpu in ends)  # CPU seconds of all ranks on the task
        found = sorted({line for lines, _ in ends for line in lines})
        if found:
            self.leaks.append((name, found))
            warnings.warn(
                f"task {name} left state behind on the ranks, put back before the next task: "
                + "; ".join(found),
                stacklevel=2,
            )
        return results

    def _recover(self, name: str) -> bool:
        """After a task that raised on every rank: each rank drops the task's process group
        and puts its state back; whether all did (else the world is not reused)."""
        try:
            for conn in self.conns:
                conn.send_bytes(pickle.dumps(("recover",)))
            self._await_all("idle", TEARDOWN_LIMIT, "recovery after the task", name)
        except (supervise.LaunchError, OSError):
            return False
        return True

    def close(self) -> None:
        """Stop the ranks: they leave on their own when they are idle, else they are killed."""
        for conn in self.conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send_bytes(pickle.dumps(("close",)))
        end = time.monotonic() + 10.0
        if not self.broken:
            for p in self.procs:
                p.join(max(0.0, end - time.monotonic()))
        supervise.stop(self.procs)
        for conn in self.conns:
            conn.close()
        self.conns = []
        self.broken = True
        self.store = None


class Worlds:
    """One ``World`` per number of ranks, each started when a task first needs it and
    replaced when it breaks. ``started`` counts the worlds started, by size."""

    def __init__(self):
        self.worlds: dict[int, World] = {}
        self.started: dict[int, int] = {}
        self.log: list[dict] = []  # every task: its ranks, its name, seconds, whether it failed
        # coverage's configuration as it is now (``coverage run``), for every world started
        self.start_env = {k: os.environ[k] for k in (COVERAGE_ENV,) if k in os.environ}

    def world(self, nprocs: int) -> World:
        found = self.worlds.get(nprocs)
        if found is None or found.broken:
            if found is not None:
                found.close()
            self.worlds[nprocs] = found = World(nprocs, start_env=self.start_env)
            self.started[nprocs] = self.started.get(nprocs, 0) + 1
        return found

    def run(self, fn, nprocs: int, *args, timeout: float = 300.0, env=None, **kwargs) -> list:
        """``World.run`` on the world of ``nprocs`` ranks."""
        start, failed = time.monotonic(), True
        try:
            world = self.world(nprocs)
            results = world.run(fn, *args, timeout=timeout, env=env, **kwargs)
            failed = False
            return results
        finally:
            name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
            seconds = round(time.monotonic() - start, 3)
            cpu = 0.0 if failed else round(self.worlds[nprocs].last_cpu, 3)
            self.log.append(
                {"ranks": nprocs, "task": name, "seconds": seconds, "cpu": cpu, "failed": failed}
            )

    def takes(self, backend: str, start_method: str, hang_timeout, forward_signals) -> bool:
        """Whether a ``launch`` call can run in a world here: its ``backend`` (resolved) is gloo,
        its ranks would be spawned (``start_method``, as launch picked it: a call that forks
        wants ranks that are copies of the caller, as it is now), with no watchdog and no
        signals forwarded."""
        return (
            backend == "gloo"
            and start_method != "fork"
            and hang_timeout is None
            and not forward_signals
        )

    def close(self) -> None:
        for world in self.worlds.values():
            world.close()
        self.worlds.clear()


@contextlib.contextmanager
def serving(worlds: Worlds):
    """While active, ``twinshard.ranks.launch.launch`` runs every call that ``worlds.takes`` in
    ``worlds``."""
    previous = launch.shared_worlds
    launch.shared_worlds = worlds
    try:
        yield worlds
    finally:
        launch.shared_worlds = previous
