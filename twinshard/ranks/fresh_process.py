"""One call in a fresh process, which ends without finalizing its interpreter.

The fake-accelerator run, the schedule recorded on it, the memory planner and the simulated
network each need a process of their own: they register a device or a process-group backend
for good, or set the process's thread count. ``call`` starts one (forked from the fork server,
with the caller's environment and output, or spawned: ``twinshard.ranks.fork_server``), runs the
function there and returns its result (or raises its exception, with the child's traceback as
the cause).

[Note: a worker's exit]
Such a process leaves threads behind that still hold Python objects: autograd's thread for the
fake accelerator (backward on a non-CPU device runs on a thread of its own, which can drop the
last reference to a finished backward's graph task, with the Python callbacks FSDP queued on
it, after the main thread went on: the core dump of the abort below shows exactly that),
the simulated network's wire thread, a gloo worker (``twinshard/train/cli.py``, [Note: a
torchrun rank's exit]). Dropping a Python object takes the GIL; a thread that asks for it while
the interpreter finalizes is ended by Python inside a C++ destructor, and the process aborts
("terminate called without an active exception") after its work was done: 2 of 10
fake-accelerator runs did so on the 2-core VM, and one in CI. So the child sends its answer and
``leave``s: its output flushed and its log handlers closed, it ends with ``os._exit``, as
``twinshard.ranks.launch``'s ranks and a torchrun rank of ``twinshard train`` do; nothing is left to
save by then.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import traceback
from typing import NoReturn

from . import fork_server


class ChildTraceback(Exception):
    """The traceback of an exception raised in the child process, as text."""

    def __str__(self) -> str:
        return f"\n\nin the fresh process:\n{self.args[0]}"


def call(fn, *args, timeout: float, **kwargs):
    """``fn(*args, **kwargs)`` in a fresh process; its result, or its exception.
    ``TimeoutError`` (the process is stopped) when it has not answered within ``timeout``
    seconds; ``RuntimeError`` when it ended without answering."""
    ctx, caller = fork_server.fresh()
    receive, send = ctx.Pipe(duplex=False)
    parent = None if caller else os.getpid()  # a fork server's child has the server as parent
    child = ctx.Process(target=_serve, args=(send, fn, args, kwargs, parent, caller), daemon=True)
    child.start()
    send.close()  # the child holds the only sending end: its death ends the wait below
    name = getattr(fn, "__qualname__", repr(fn))
    answer, answered = None, True
    try:
        if not (answered := receive.poll(timeout)):
            raise TimeoutError(f"{name}: no answer from its process within {timeout:.0f} s")
        answer = receive.recv()
    except EOFError:
        pass  # it ended without answering: said below, once it has been joined
    finally:
        receive.close()
        child.join(10 if answered else 0)  # one that timed out is stopped at once
        if child.is_alive():
            child.kill()
            child.join()
    if answer is None:
        raise RuntimeError(
            f"{name}: its process ended (exit code {child.exitcode}) without answering; its "
            "output above says why"
        )
    if answer[0] == "error":
        _, error, text = answer
        raise error from ChildTraceback(text)
    return answer[1]


def _serve(send, fn, args, kwargs, parent_pid: int | None, caller) -> None:
    begin_as_child(caller, parent_pid)  # a daemon outlives a parent stopped by a signal otherwise
    try:
        answer = ("ok", fn(*args, **kwargs))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
        answer = ("error", e, traceback.format_exc())
    try:
        send.send(answer)
    except Exception:  # noqa: BLE001 - an answer that cannot be pickled
        text = traceback.format_exc()
        send.send(("error", RuntimeError(text), text))
    send.close()
    leave(0)


def begin_as_child(caller, parent_pid: int | None) -> None:
    """First thing in a fresh process: the caller's state where it was forked from the fork
    server (``caller``, a ``fork_server.Caller``, else None), then ``die_with_parent``."""
    if caller is not None:
        caller.become()
    die_with_parent(parent_pid)


def die_with_parent(parent_pid: int | None) -> None:
    """Have the kernel SIGKILL this process when its parent dies, however it dies
    (``PR_SET_PDEATHSIG`` on Linux); leave at once if the parent ``parent_pid`` is already
    gone. Used by ``call``'s child and by ``twinshard.ranks.launch``'s ranks."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)  # the parent died before the line above took effect


def leave(code: int) -> NoReturn:
    """End this process with ``code`` now, without finalizing the interpreter; output is
    flushed and log handlers are closed first. See [Note: a worker's exit]."""
    try:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)
