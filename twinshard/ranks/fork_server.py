"""Ranks forked from a server that imported torch once, in place of interpreters that each
import it again.

[Note: ranks from a fork server]
A spawned rank is a new interpreter: before it runs anything it imports torch and twinshard,
4 to 5 CPU seconds on a 2-core machine, which is more than most conformance cases take.
``twinshard conform`` at meshes 2, 3 and 2x2 started nine such ranks, one after another, and
on this machine a third of its wall time was imports. So ``launch`` (and
``fresh_process.call``) start a process from multiprocessing's fork server instead: a process
of its own that imports ``PRELOAD`` once, when this process first needs it, and forks every
later rank from that state. The server never joins a group, starts a thread pool or touches a
device, so each rank is as clean as a spawned one, only with torch already imported.

A fork copies the server as it was when it started, not the caller as it is now. Three things
are made the caller's again, as spawn gives them:
- the environment: ``Caller`` takes the caller's ``os.environ`` at the launch, and the rank
  replaces the server's with it before anything else;
- the working directory and ``sys.path``: multiprocessing's preparation data carries them, as
  for spawn;
- standard output and error: the caller's descriptors 1 and 2 at the launch travel with the
  rank (passed over the server's socket) and are put in place, so output the caller captures
  (pytest's capture, a subprocess pipe) holds the rank's output.
The server ends when the caller does, and its ranks with it: each rank drops the pipe by which
multiprocessing keeps the server alive while any process it started runs, and the kernel
kills a rank whose parent, the server, is gone (``fresh_process.die_with_parent``).
Coverage follows the caller too (``coverage run`` with subprocess patching): a rank whose
caller measures is measured, in a data file of its own, and the server's collector, if any,
is stopped in a rank whose caller does not.

What stays the server's: the modules of ``PRELOAD``, torch and twinshard's own, as they were
imported when the server started. A user's modules are never preloaded, so a rank imports
them from the disk as they are at the launch. Where a rank must be a new interpreter (a
module of ``PRELOAD`` edited since, or an environment variable that torch reads only when it
is imported), ``start_method="spawn"`` still spawns.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from multiprocessing import forkserver, reduction

from .rank_reset import PRELOADED

# what the server imports once: torch, and what nearly every rank imports (a shared world's
# ranks import the same, ``twinshard.ranks.rank_reset.PRELOADED``)
PRELOAD = ("torch", "torch.distributed", "twinshard.ranks.launch", *PRELOADED)
COVERAGE_ENV = "COVERAGE_PROCESS_CONFIG"  # set by ``coverage run`` with subprocess patching


# how a fresh process starts here: forked from the server where the platform has one
START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


def fresh() -> tuple[mp.context.BaseContext, Caller | None]:
    """The context that starts a fresh process here, and what the process must take of the
    caller (``Caller.become`` first thing in it), or None where it is spawned."""
    if START_METHOD == "forkserver":
        return context(), Caller()
    return mp.get_context("spawn"), None


def context() -> mp.context.BaseContext:
    """multiprocessing's fork-server context, its server to import ``PRELOAD`` when it starts
    (the first process started through it in this process starts it)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


class Caller:
    """The caller's environment and standard output and error at a launch, for a process
    started from the fork server (pickled with the process: its descriptors are duplicated
    into the process by multiprocessing)."""

    def __init__(self):
        self.environ = dict(os.environ)
        self.stdio: dict[int, int] = {}  # in the child: the caller's 1 and 2, as received

    def __reduce__(self):
        fds = [fd for fd in (1, 2) if _is_open(fd)]
        return (_received, (self.environ, fds, [reduction.DupFd(fd) for fd in fds]))

    def become(self) -> None:
        """In the forked process, before anything else: the caller's environment, output and
        coverage in place of the server's."""
        for fd, received in self.stdio.items():
            (sys.stdout if fd == 1 else sys.stderr).flush()
            os.dup2(received, fd)
            os.close(received)
        os.environ.clear()
        os.environ.update(self.environ)
        _measure_as_caller(COVERAGE_ENV in self.environ)
        _let_the_server_go()


def _let_the_server_go() -> None:
    """Drop this process's copy of the server's "alive" pipe. multiprocessing hands one to every
    process the server starts, and the server stays until none is left; a rank that kept it
    would keep the server alive after the caller died, and the server would keep the rank
    alive (its death is what kills the rank: ``fresh_process.die_with_parent``)."""
    server = forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


def _received(environ: dict, fds: list[int], duplicated: list) -> Caller:
    caller = Caller.__new__(Caller)
    caller.environ = environ
    caller.stdio = {fd: d.detach() for fd, d in zip(fds, duplicated)}
    return caller


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _measure_as_caller(measured: bool) -> None:
    """Start coverage here where the caller measures and this process does not yet, in a data
    file of its own; stop a collector copied from the server where the caller does not."""
    coverage = sys.modules.get("coverage")
    running = coverage.Coverage.current() if coverage else None
    if running is not None:
        running._auto_save = False  # its data is the server's: nothing of it is written here
        running.stop()
    if measured:
        import coverage

        coverage.process_startup(force=True, slug="fork")
