"""twinshard.ranks.fresh_process: one call in a spawned process that ends without finalizing.

The fake-accelerator run, the schedule on it, the memory planner and the simulated network run
their work this way ([Note: a worker's exit]); here its answers, its errors and its ends.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time

import pytest

from twinshard.ranks import fresh_process


def _answer(x, y=0):
    return {"sum": x + y, "pid": os.getpid()}


def _fails(name):
    raise KeyError(f"no parameter named {name}")


def _marks_exit(path):
    atexit.register(lambda: open(path, "w").write("finalized"))
    return "done"


def _sleeps(seconds):
    time.sleep(seconds)


def _dies():
    os._exit(3)


def test_the_result_comes_from_another_process():
    got = fresh_process.call(_answer, 2, y=3, timeout=60)
    assert got["sum"] == 5 and got["pid"] != os.getpid()


def test_an_error_is_raised_here_with_its_type_and_the_child_s_traceback():
    with pytest.raises(KeyError, match="no parameter named wq") as caught:
        fresh_process.call(_fails, "wq", timeout=60)
    cause = caught.value.__cause__
    assert isinstance(cause, fresh_process.ChildTraceback) and "_fails" in str(cause)


def test_the_child_ends_without_finalizing_its_interpreter(tmp_path):
    """No atexit handler runs in it: nothing runs while threads could lose the interpreter."""
    marker = tmp_path / "marker"
    assert fresh_process.call(_marks_exit, str(marker), timeout=60) == "done"
    assert not marker.exists()


def test_a_silent_child_is_stopped_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="_sleeps: no answer from its process within 2 s"):
        fresh_process.call(_sleeps, 120, timeout=2)
    assert time.monotonic() - start < 60


def test_a_child_that_dies_is_named_with_its_exit_code():
    with pytest.raises(RuntimeError, match=r"_dies: its process ended \(exit code 3\)"):
        fresh_process.call(_dies, timeout=60)


ORPHAN = """
import multiprocessing, threading, time
from twinshard.ranks import fresh_process
call = lambda: fresh_process.call(time.sleep, 600, timeout=700)
threading.Thread(target=call, daemon=True).start()
while not multiprocessing.active_children():
    time.sleep(0.05)
print(multiprocessing.active_children()[0].pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" not in f.read()  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_child_dies_with_a_parent_stopped_by_a_signal():
    parent = subprocess.Popen([sys.executable, "-c", ORPHAN], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.send_signal(signal.SIGTERM)  # no atexit: the daemon is not stopped by Python
        parent.wait(30)
        deadline = time.monotonic() + 20
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), f"the child {child} outlived its parent"
    finally:
        parent.kill()
