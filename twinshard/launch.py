"""Run a function on N local ranks and collect what each rank returns.

``launch(fn, nprocs, *args, **kwargs)`` starts ``nprocs`` child processes. Each sets
``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``, joins
a process group, calls ``fn``, sends the return value back and destroys the group.
The parent gets the values as a list ordered by rank. The parent never joins a group,
even with one rank, and refuses to run if it has initialized ``torch.distributed``
itself (a forked child would inherit that group).

Why it cannot hang. Each rank has a one-way pipe to the parent, which waits on all
the pipes and process sentinels at once, so it wakes as soon as a rank reports or
dies. It never joins a process that may still be writing, and reads a result of any
size while it is written. Results go through plain ``pickle``, so tensors are copied
into the message, not shared through memory that vanishes with the child. When a
rank raises or dies, the parent waits a moment for its peers' reports, then
terminates the rest (SIGTERM, then SIGKILL), since they may be blocked in a
collective that will never finish, and raises ``LaunchError`` naming the rank, with
the exception type and the child's traceback, or the exit code of a rank that died
without a report. Peers that failed only because it vanished ("connection closed by
peer") are listed after it. A wall-clock deadline covers the rest: the ranks get
``timeout`` + 60 s to start and join the group, then ``fn`` gets ``timeout`` seconds
and a little slack, so a collective's own timeout (also ``timeout``) can fire first.

Fork or spawn. ``spawn`` starts a fresh interpreter that imports ``fn`` by module and
name. It is the safer choice, but it cannot run a lambda, a closure, a nested
function, or a function from a notebook, ``python -c`` or another ``__main__``
without a file. With ``start_method=None``, ``launch`` forks for those (the child is
a copy of the parent; nothing is imported) and spawns otherwise. Forking after CUDA
is initialized is unsafe, so GPU code should use module-level functions. Forcing
``"spawn"`` with an unpicklable ``fn`` or arguments raises ``TypeError`` up front.

Each child calls ``torch.set_num_threads(1)``, since a few ranks share a few cores;
``TWINSHARD_THREADS=n`` asks for ``n`` threads, ``0`` keeps torch's default. Inside
``fn``, ``get_rank_info()`` gives the rank, local rank, world size, backend, device.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = ["LaunchError", "RankInfo", "get_rank_info", "launch"]

_STARTUP_MARGIN = 60.0  # extra seconds for the ranks to start and join the group
_EXIT_GRACE = 10.0  # how long a rank that has reported gets to exit by itself
_KILL_GRACE = 2.0  # how long to wait after SIGTERM before SIGKILL
_POLL = 0.5  # the longest the parent sleeps between checks
_DRAIN = 1.0  # after a failure, how long to wait for the other ranks' reports
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
    first (the likely cause); ``failures``: every failed rank -> what happened."""

    def __init__(self, message: str, ranks: list[int], failures: dict[int, str]):
        super().__init__(message)
        self.ranks = list(ranks)
        self.failures = dict(failures)


class RankInfo(NamedTuple):
    """What a rank needs to know about itself."""

    rank: int
    local_rank: int
    world_size: int
    backend: str
    device: torch.device


_RANK_INFO: RankInfo | None = None


def get_rank_info() -> RankInfo:
    """Return this rank's ``RankInfo``. Works only inside a function run by ``launch``."""
    if _RANK_INFO is None:
        raise RuntimeError(
            "get_rank_info() only works inside a function run by twinshard.launch.launch()"
        )
    return _RANK_INFO


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolve_backend(backend: str | None, nprocs: int) -> str:
    # device_count() asks NVML first, so it does not initialize CUDA and fork stays safe.
    gpus = torch.cuda.device_count()
    if backend is None:
        return "nccl" if 0 < nprocs <= gpus and dist.is_nccl_available() else "gloo"
    name = backend.lower() if isinstance(backend, str) else backend
    if name not in dist.Backend.backend_list or name == "undefined":
        raise ValueError(
            f"unknown backend {backend!r}; expected one of {dist.Backend.backend_list[1:]}"
        )
    if not dist.is_backend_available(name):
        raise ValueError(f"backend {name!r} is not available in this build of torch")
    if name == "nccl" and nprocs > gpus:
        raise ValueError(
            f"backend 'nccl' needs one GPU per rank: nprocs={nprocs} but {gpus} GPU(s) visible"
        )
    return name


def _pick_start_method(fn: Callable, args: tuple, kwargs: dict, start_method: str | None) -> str:
    """Fork when a spawned child could not import ``fn`` by module and name, else spawn."""
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
    if start_method == "fork" or (start_method is None and unimportable):
        return "fork"
    try:
        pickle.dumps((fn, args, kwargs))
    except Exception as e:
        if start_method is None:
            return "fork"
        raise TypeError(
            f"with start_method={start_method!r}, fn must be a module-level function and its "
            f"arguments picklable ({type(e).__name__}: {e})"
        ) from e
    return start_method or "spawn"


def _worker(fn, args, kwargs, rank, world_size, port, backend, timeout, env, conn) -> None:
    global _RANK_INFO
    try:
        os.environ.update(env)
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
        )
        threads = int(os.environ.get("TWINSHARD_THREADS", "1") or "0")
        if threads > 0:
            torch.set_num_threads(threads)
        device = torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        _RANK_INFO = RankInfo(rank, rank, world_size, backend, device)
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
        )
        conn.send_bytes(pickle.dumps(("ready",)))
        result = fn(*args, **kwargs)
        conn.send_bytes(pickle.dumps(("ok", result), protocol=pickle.HIGHEST_PROTOCOL))
    except BaseException as e:  # noqa: BLE001 - everything is reported to the parent
        kind = f"{type(e).__module__}.{type(e).__qualname__}".removeprefix("builtins.")
        try:
            conn.send_bytes(pickle.dumps(("error", kind, str(e), traceback.format_exc())))
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(1)  # skip teardown: peers may be stuck, and the parent stops them anyway
    try:
        if dist.is_initialized():
            dist.barrier()  # nobody tears down while a peer still talks to it
            dist.destroy_process_group()
    finally:
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        # Communication threads left behind by subgroups (device meshes) can abort the
        # interpreter's own shutdown; the result is already delivered, so leave directly.
        os._exit(0)


def _stop(procs: list) -> None:
    """Terminate every live process, then kill what is left."""
    for signal_them in (mp.Process.terminate, mp.Process.kill):
        live = [p for p in procs if p.is_alive()]
        for p in live:
            signal_them(p)
        end = time.monotonic() + _KILL_GRACE
        for p in live:
            p.join(max(0.0, end - time.monotonic()))


def _error(headline: str, failures: dict[int, str]) -> LaunchError:
    def knock_on(text: str) -> bool:
        return any(k in text.split("\n", 1)[0].lower() for k in _KNOCK_ON)

    first = [r for r, text in failures.items() if not knock_on(text)] or list(failures)
    later = [r for r in failures if r not in first]
    message = f"{headline}: rank(s) {', '.join(map(str, first))}"
    if later:
        message += f"; then rank(s) {', '.join(map(str, later))}, probably as a consequence"
    message += "".join(f"\n\n--- rank {r} ---\n{failures[r]}" for r in first + later)
    return LaunchError(message, first, failures)


def _collect(procs: list, conns: list, timeout: float) -> list:
    """Read every rank's reports until all have returned, one fails or time runs out."""
    n, ready, results, failures = len(procs), set(), {}, {}

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

    def wait_and_poll(until: float) -> list[int]:
        pending = [r for r in range(n) if r not in results and r not in failures]
        wait(
            [conns[r] for r in pending] + [procs[r].sentinel for r in pending],
            timeout=max(0.0, min(_POLL, until - time.monotonic())),
        )
        for r in pending:
            poll(r)
        return [r for r in pending if r not in results and r not in failures]

    deadline, all_ready = time.monotonic() + timeout + _STARTUP_MARGIN, False
    while not failures and (pending := wait_and_poll(deadline)):
        if not all_ready and len(ready) == n:
            all_ready, deadline = True, time.monotonic() + timeout + min(5.0, 0.1 * timeout)
        if time.monotonic() >= deadline and not failures:
            late = {
                r: "had not finished " + ("fn" if r in ready else "starting up") for r in pending
            }
            raise _error(f"deadline of {timeout}s exceeded", late)
    if failures:  # peers of a failed rank often fail a moment later: collect them briefly
        end = time.monotonic() + _DRAIN
        while wait_and_poll(end) and time.monotonic() < end:
            pass
        raise _error("launch failed", failures)

    end = time.monotonic() + _EXIT_GRACE  # all returned: let them tear down and exit
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    if stuck := [r for r, p in enumerate(procs) if p.is_alive()]:
        warnings.warn(
            f"rank(s) {stuck} returned but did not exit within {_EXIT_GRACE}s; killing them",
            stacklevel=2,
        )
    bad = {
        r: f"returned a result but then exited with code {p.exitcode}"
        for r, p in enumerate(procs)
        if p.exitcode not in (0, None)
    }
    if bad:
        raise _error("launch failed during teardown", bad)
    return [results[r] for r in range(n)]


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str | None = None,
    timeout: float = 300.0,
    start_method: str | None = None,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` local ranks; return the results by rank.

    ``backend``: default "nccl" (one GPU per rank) if there are enough GPUs, else "gloo".
    ``timeout``: seconds, for the process group and as the deadline for ``fn``.
    ``start_method``: None picks fork or spawn (see the module docstring).
    ``env``: extra environment variables for the children. Raises ``ValueError`` for
    bad arguments, ``TypeError`` if ``fn`` cannot be spawned, ``LaunchError`` if a rank fails.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be an integer >= 1, got {nprocs!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build of torch")
    if dist.is_initialized():
        raise RuntimeError(
            "launch() must be called from a process that has not initialized torch.distributed"
        )
    backend = _resolve_backend(backend, nprocs)
    ctx = mp.get_context(_pick_start_method(fn, args, kwargs, start_method))
    env = {str(k): str(v) for k, v in (env or {}).items()}
    port = _free_port()
    procs, conns = [], []
    try:
        for rank in range(nprocs):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_worker,
                name=f"twinshard-rank{rank}",
                args=(fn, args, kwargs, rank, nprocs, port, backend, timeout, env, writer),
            )
            p.start()
            writer.close()  # keep only the child's copy, so its death reads as EOF
            procs.append(p)
            conns.append(reader)
        return _collect(procs, conns, timeout)
    finally:
        _stop(procs)
        for c in conns:
            c.close()
