"""Run a function on N local ranks and collect what each rank returns.

``launch(fn, nprocs, *args, **kwargs)`` starts ``nprocs`` child processes. Each sets
``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``, joins
a process group, calls ``fn``, sends the return value back and destroys the group.
The parent gets the values as a list ordered by rank. The parent never joins a group,
even with one rank, and refuses to run if it has initialized ``torch.distributed``
itself (a forked child would inherit that group).

Why it cannot hang. Each rank has a one-way pipe to the parent, which waits on all of
them (``twinshard.ranks.supervise``). Results go through plain ``pickle``, so tensors are copied
into the message, not shared through memory that vanishes with the child. When a rank
raises or dies, the parent terminates the rest, since they may be blocked in a collective
that will never finish, and raises ``LaunchError`` naming the rank, with the exception
type and the child's traceback, or the exit code of a rank that died without a report.
A wall-clock deadline covers the rest: the ranks get ``timeout`` + 60 s to start and join
the group (at most ``TWINSHARD_STARTUP_LIMIT`` seconds, 120 by default; the error names the
ranks that did not), then ``fn`` gets ``timeout`` seconds and a little slack, so a
collective's own timeout (also ``timeout``) can fire first. With ``hang_timeout``, a watchdog
(``twinshard.ranks.watchdog``) stops a run in which no rank made progress for that long, dumps
every rank's Python stack and raises ``HangError`` naming the stalled rank.

One run, one owner. The parent binds the rendezvous store's port itself and holds it until
the run ends (a port taken between choosing and binding is replaced by another), so no other
process can take it from the ranks. Each rank asks the kernel to kill it when the parent
dies (``PR_SET_PDEATHSIG`` on Linux), so SIGKILL or SIGTERM to the parent leaves no rank
behind. With ``forward_signals=True``, SIGINT and SIGTERM are passed on to the ranks instead,
which decide how to stop; a second one stops them at once.

Fork, or a fresh rank. A fresh rank imports ``fn`` by module and name. It is the safer
choice, but it cannot run a lambda, a closure, a nested function, or a function from a
notebook, ``python -c`` or another ``__main__`` without a file. With ``start_method=None``,
``launch`` forks for those (the child is a copy of the parent; nothing is imported) and starts
fresh ranks otherwise: forked from a server that imported torch once (``"forkserver"``,
[Note: ranks from a fork server] in ``twinshard.ranks.fork_server``), with the caller's
environment, directory and output, where the platform has one, else spawned (``"spawn"``, a new
interpreter, which may always be asked for). A child forked after this process initialized
CUDA (or another accelerator's runtime: ``twinshard.ranks.devices.initialized_accelerator``)
cannot use the device, so then ``launch`` starts fresh ranks (the fork server never touches a
device), and where ``fn`` can only be forked (or ``"fork"`` was asked for) it raises
``RuntimeError`` naming ``fn`` and saying what to do. Forcing ``"spawn"`` with an
unpicklable ``fn`` or arguments raises ``TypeError`` up front.

Devices. With no ``backend``, the ranks run one per accelerator with its backend (nccl on
CUDA, xccl on XPU) when there are enough devices, else on the CPU with gloo. A rank of a
backend that runs on an accelerator only gets device ``local_rank``, made current and passed
to ``init_process_group`` as ``device_id`` (torch's advice for NCCL: the communicator is
made at once and bound to the rank's device); a rank of a host backend (gloo) computes on
the CPU, even on a GPU machine. ``twinshard.ranks.devices`` remembers the choice, so the default
mesh and ``twinshard train`` follow it (``twinshard.ranks.devices`` has the rules).

Shared worlds. Inside ``twinshard.ranks.worlds.serving(worlds)`` (the test suite's whole session), a
call whose ranks would be spawned (CPU ranks, no watchdog, no forwarded signals) runs in ranks
started once and reused, with the same results and errors; see ``twinshard.ranks.worlds``. A call
that forks keeps forking: its ranks must see this process as it is, and a fork is cheap.

Each child calls ``torch.set_num_threads(1)``, since a few ranks share a few cores;
``TWINSHARD_THREADS=n`` asks for ``n`` threads, ``0`` keeps torch's default. Inside
``fn``, ``get_rank_info()`` gives the rank, local rank, world size, backend, device.
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from . import devices, fork_server, fresh_process, watchdog
from .supervise import HangError, LaunchError, Watch, collect, forwarding, stop

__all__ = ["HangError", "LaunchError", "RankInfo", "get_rank_info", "launch"]

_PORT_TRIES = 10  # ports tried for the store before giving up
FRESH = fork_server.START_METHOD  # how a fresh rank starts: [Note: ranks from a fork server]


class RankInfo(NamedTuple):
    """What a rank needs to know about itself."""

    rank: int
    local_rank: int
    world_size: int
    backend: str
    device: torch.device


_RANK_INFO: RankInfo | None = None
# A twinshard.ranks.worlds.Worlds that runs the calls it can serve in ranks started once
# (twinshard.ranks.worlds.serving), or None: every call launches its own ranks.
shared_worlds = None


def get_rank_info() -> RankInfo:
    """Return this rank's ``RankInfo``. Works only inside a function run by ``launch``."""
    if _RANK_INFO is None:
        raise RuntimeError(
            "get_rank_info() only works inside a function run by twinshard.ranks.launch.launch()"
        )
    return _RANK_INFO


def bind_rank_info(rank: int, world_size: int, backend: str) -> RankInfo:
    """Make ``get_rank_info()`` answer for this process: rank ``rank`` of ``world_size`` local
    ranks on ``backend`` (also used by ``twinshard.ranks.worlds``' ranks)."""
    global _RANK_INFO
    device = devices.backend_device(backend, rank)  # an accelerator each for nccl, xccl
    _RANK_INFO = RankInfo(rank, rank, world_size, backend, device)
    return _RANK_INFO


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolve_backend(backend: str | None, nprocs: int) -> str:
    # The device counts come from NVML where they can (on CUDA), so fork stays safe.
    if backend is None:
        return devices.accelerator_backend(nprocs) or "gloo"
    name = backend.lower() if isinstance(backend, str) else backend
    if name not in dist.Backend.backend_list or name == "undefined":
        raise ValueError(
            f"unknown backend {backend!r}; expected one of {dist.Backend.backend_list[1:]}"
        )
    if not dist.is_backend_available(name):
        raise ValueError(f"backend {name!r} is not available in this build of torch")
    kind = devices.backend_device(name, 0).type
    if kind != "cpu" and nprocs > (found := devices.device_count(kind)):
        raise ValueError(
            f"backend {name!r} needs one {kind} device (GPU) per rank: nprocs={nprocs} but "
            f"{found} visible; use fewer ranks or backend='gloo'"
        )
    return name


def _pick_start_method(fn: Callable, args: tuple, kwargs: dict, start_method: str | None) -> str:
    """Fork when a fresh child could not import ``fn`` by module and name, else ``FRESH``; never
    fork once this process has initialized an accelerator's runtime (``RuntimeError``)."""
    if start_method not in (None, "fork", "spawn", "forkserver"):
        raise ValueError(
            f"unknown start_method {start_method!r}; use None, 'fork', 'spawn' or 'forkserver'"
        )
    name = getattr(fn, "__qualname__", "")
    main_file = getattr(sys.modules["__main__"], "__file__", None)  # "<stdin>" is no file
    unimportable = (
        "<lambda>" in name
        or "<locals>" in name
        or (
            getattr(fn, "__module__", None) == "__main__"
            and not (main_file and os.path.isfile(main_file))
        )
    )
    runtime = devices.initialized_accelerator()  # a forked child could not use it
    if start_method == "fork" or (start_method is None and unimportable):
        if runtime:
            why = "a lambda, a nested function or from a __main__ without a file"
            why = "start_method='fork' was asked for" if start_method else f"it is {why}"
            raise RuntimeError(_fork_refused(fn, runtime, why))
        return "fork"
    try:
        pickle.dumps((fn, args, kwargs))
    except Exception as e:
        if start_method is None:
            if runtime:
                why = f"it or its arguments cannot be pickled ({type(e).__name__}: {e})"
                raise RuntimeError(_fork_refused(fn, runtime, why)) from e
            return "fork"
        raise TypeError(
            f"with start_method={start_method!r}, fn must be a module-level function and its "
            f"arguments picklable ({type(e).__name__}: {e})"
        ) from e
    return start_method or FRESH


def _fork_refused(fn: Callable, runtime: str, why: str) -> str:
    """The error for a launch that would fork after the accelerator runtime was initialized."""
    where = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    return (
        f"launch cannot run {where}: {why}, so its ranks would be forked, but this process "
        f"has already initialized {runtime}, which a forked rank cannot use. Make it a "
        "module-level function in an importable file, with picklable arguments (launch then "
        f"spawns the ranks), or call launch before the first {runtime} call of this process"
    )


class _Setup(NamedTuple):
    """What a rank gets from the parent besides ``fn`` and its arguments."""

    rank: int
    world_size: int
    port: int  # of the parent's store
    backend: str
    timeout: float
    env: dict
    parent_pid: int | None  # None: a fork server started the rank, not the launcher
    hang_timeout: float | None
    stack_dir: str | None
    caller: fork_server.Caller | None  # for a rank from the fork server: the caller's state


def listen_for_ranks() -> socket.socket:
    """A socket listening on a free port, held until the store server takes it over
    (``serve_store``); the ranks connect to it."""
    for attempt in range(_PORT_TRIES):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("127.0.0.1", _free_port()))
            sock.listen(1024)
            return sock
        except OSError as e:  # taken since _free_port chose it: choose again
            sock.close()
            if e.errno != errno.EADDRINUSE or attempt == _PORT_TRIES - 1:
                raise
    raise AssertionError("unreachable")


def serve_store(listener: socket.socket, timeout: float) -> dist.TCPStore:
    """The rendezvous store, served by this process on the socket ``listen_for_ranks`` bound. Started
    after the ranks: forking a process that runs the server's thread could break the child."""
    return dist.TCPStore(
        "127.0.0.1",
        listener.getsockname()[1],
        None,
        True,
        timeout=timedelta(seconds=timeout),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),  # the store closes it when it is gone
    )


def _worker(fn, args, kwargs, setup: _Setup, conn) -> None:
    rank, world_size, backend, timeout = setup.rank, setup.world_size, setup.backend, setup.timeout
    try:
        fresh_process.begin_as_child(setup.caller, setup.parent_pid)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a fork copies the parent's
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.update(setup.env)
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(setup.port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
        )
        threads = int(os.environ.get("TWINSHARD_THREADS", "1") or "0")
        if threads > 0:
            torch.set_num_threads(threads)
        bind_rank_info(rank, world_size, backend)
        store = dist.TCPStore(
            "127.0.0.1", setup.port, None, False, timeout=timedelta(seconds=timeout)
        )
        if setup.hang_timeout:
            stacks = open(os.path.join(setup.stack_dir, f"rank{rank}.txt"), "w")
            watched = dist.PrefixStore(watchdog.PREFIX, store)
            watchdog.start_rank(watched, rank, setup.hang_timeout, stacks)
            watchdog.progress("joining the process group")
        devices.join_group(  # device_id for an accelerator rank, as torch recommends
            backend,
            rank,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        conn.send_bytes(pickle.dumps(("ready",)))
        watchdog.progress("running")
        result = fn(*args, **kwargs)
        watchdog.progress("returned")
        conn.send_bytes(pickle.dumps(("ok", result), protocol=pickle.HIGHEST_PROTOCOL))
    except BaseException as e:  # noqa: BLE001 - everything is reported to the parent
        kind = f"{type(e).__module__}.{type(e).__qualname__}".removeprefix("builtins.")
        try:
            conn.send_bytes(pickle.dumps(("error", kind, str(e), traceback.format_exc())))
        finally:
            fresh_process.leave(1)  # skip teardown: peers may be stuck, the parent stops them
    try:
        if dist.is_initialized():
            dist.barrier()  # nobody tears down while a peer still talks to it
            dist.destroy_process_group()
    finally:
        conn.close()
        # Communication threads left behind by subgroups (device meshes) can abort the
        # interpreter's own shutdown; the result is already delivered, so leave directly.
        fresh_process.leave(0)


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str | None = None,
    timeout: float = 300.0,
    start_method: str | None = None,
    env: dict[str, str] | None = None,
    hang_timeout: float | None = None,
    forward_signals: bool = False,
    **kwargs: Any,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` local ranks; return the results by rank.

    ``backend``: default: the accelerator's (nccl, one GPU per rank) if there are enough
    devices, else "gloo" (CPU ranks).
    ``timeout``: seconds, for the process group and as the deadline for ``fn``.
    ``start_method``: None picks fork or a fresh rank (see the module docstring).
    ``env``: extra environment variables for the children.
    ``hang_timeout``: seconds without progress on any rank before the watchdog stops the run
    and raises ``HangError`` (a ``LaunchError``); None: no watchdog. ``fn`` may call
    ``twinshard.ranks.watchdog.progress("...")``; collectives count as progress by themselves.
    ``forward_signals``: pass SIGINT and SIGTERM on to the ranks (see the module docstring).
    Raises ``ValueError`` for bad arguments, ``TypeError`` if ``fn`` cannot be spawned,
    ``RuntimeError`` if it would have to be forked after CUDA was initialized,
    ``LaunchError`` if a rank fails.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be an integer >= 1, got {nprocs!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    if hang_timeout is not None and not hang_timeout > 0:
        raise ValueError(f"hang_timeout must be positive or None, got {hang_timeout!r}")
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build of torch")
    if dist.is_initialized():
        raise RuntimeError(
            "launch() must be called from a process that has not initialized torch.distributed"
        )
    backend = _resolve_backend(backend, nprocs)
    method = _pick_start_method(fn, args, kwargs, start_method)
    worlds = shared_worlds
    if worlds is not None and worlds.takes(backend, method, hang_timeout, forward_signals):
        return worlds.run(fn, nprocs, *args, timeout=timeout, env=env, **kwargs)
    ctx = fork_server.context() if method == "forkserver" else mp.get_context(method)
    caller = fork_server.Caller() if method == "forkserver" else None
    env = {str(k): str(v) for k, v in (env or {}).items()}
    listener = listen_for_ranks()  # the ranks connect to it; the server takes it over once they run
    port = listener.getsockname()[1]
    stack_dir = tempfile.mkdtemp(prefix="twinshard-stacks-") if hang_timeout else None
    parent = None if method == "forkserver" else os.getpid()
    procs, conns, store, watch = [], [], None, None
    try:
        for rank in range(nprocs):
            reader, writer = ctx.Pipe(duplex=False)
            setup = _Setup(
                rank, nprocs, port, backend, timeout, env, parent, hang_timeout, stack_dir, caller
            )
            p = ctx.Process(
                target=_worker, name=f"twinshard-rank{rank}", args=(fn, args, kwargs, setup, writer)
            )
            p.start()
            writer.close()  # keep only the child's copy, so its death reads as EOF
            procs.append(p)
            conns.append(reader)
        store = serve_store(listener, timeout)
        if hang_timeout:
            watch = Watch(dist.PrefixStore(watchdog.PREFIX, store), procs, hang_timeout, stack_dir)
        with forwarding(procs, forward_signals):
            return collect(procs, conns, timeout, watch)
    finally:
        stop(procs, gently=not forward_signals)  # forwarded SIGTERM means "finish the step"
        for c in conns:
            c.close()
        listener.close()  # unless the store took it over
        if watch is not None:
            watch.close()
        del store  # the server's thread ends now, even if a traceback keeps this frame alive
        if stack_dir:
            shutil.rmtree(stack_dir, ignore_errors=True)
