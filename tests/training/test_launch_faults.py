"""twinshard.ranks.launch when things go wrong around the function: a stalled rank (the watchdog), a
launcher that is killed (no rank may outlive it), and a port taken before the store binds it.

Waits are bounded by the launcher's own limits or by subprocess timeouts; the assertions are on
what was reported, never on how long it took.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from train_support import alive, wait_until

from twinshard.ranks import launch as launch_module
from twinshard.ranks import watchdog
from twinshard.ranks.launch import HangError, LaunchError, launch
from twinshard.ranks.supervise import process_state

# Tests of launching itself: their launches start ranks of their own, not the shared worlds'.
pytestmark = pytest.mark.real_launch

# Module-level helpers: spawned children import them from this module by name.


def stop_rank_one_at_step_five():
    for step in range(10**6):
        watchdog.progress(f"step {step}")
        t = torch.ones(1)
        dist.all_reduce(t)
        if step == 5 and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
    return "unreachable"


def stop_rank_one_before_a_functional_all_reduce():
    import torch.distributed._functional_collectives as funcol

    for step in range(10**6):
        watchdog.progress(f"step {step}")
        if step == 5 and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        summed = funcol.all_reduce(torch.ones(1), "sum", dist.group.WORLD)  # returns at once
        summed.wait()  # rank 0 blocks here, in wait_tensor (as clip_grad_norm_ over DTensors)
    return "unreachable"


def spin_rank_one_outside_collectives():
    t = torch.ones(1)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        while True:  # busy in Python: alive, but no progress
            sum(range(1000))
    dist.barrier()
    return "unreachable"


def slow_but_steady(steps):
    for step in range(steps):
        time.sleep(0.3)
        watchdog.progress(f"step {step}")
        dist.all_reduce(torch.ones(1))
    return dist.get_rank()


def bind_master_port():
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
        except OSError as e:
            return e.errno
    return 0


# ------------------------------------------------------------------------------ watchdog
def test_a_stopped_rank_is_named_with_every_stack():
    with pytest.raises(HangError) as info:
        launch(stop_rank_one_at_step_five, 2, hang_timeout=3.0)
    e = info.value
    assert isinstance(e, LaunchError)
    assert e.ranks == [1]
    assert "rank(s) 1 stalled (rank 1: stopped (SIGSTOP" in e.headline
    assert "the others wait in all_reduce #" in e.headline
    assert e.failures[0].startswith("waits in all_reduce #")
    for rank in (0, 1):  # each rank's Python stack, the stopped one's included
        assert "stop_rank_one_at_step_five" in e.failures[rank], e.failures[rank]


def test_a_rank_blocked_in_a_functional_collectives_wait_is_inside_it():
    with pytest.raises(HangError) as info:
        launch(stop_rank_one_before_a_functional_all_reduce, 2, hang_timeout=3.0)
    e = info.value
    assert e.ranks == [1]
    assert "the others wait in wait for functional all_reduce #" in e.headline, e.headline
    assert e.failures[0].startswith("waits in wait for functional all_reduce #"), e.failures[0]


def test_a_rank_busy_outside_collectives_is_named():
    with pytest.raises(HangError) as info:
        launch(spin_rank_one_outside_collectives, 2, hang_timeout=3.0, start_method="fork")
    e = info.value
    assert e.ranks == [1]
    assert "rank 1: running outside any collective" in e.headline
    assert "the others wait in barrier #" in e.headline
    assert "spin_rank_one_outside_collectives" in e.failures[1]


def test_steady_progress_is_not_a_stall():
    assert launch(slow_but_steady, 2, 10, hang_timeout=5.0) == [0, 1]


def test_ranks_that_do_not_start_in_time_are_named(monkeypatch):
    """The start-up limit holds whatever the function's deadline (600 s here): spawned ranks
    cannot import torch in a fifth of a second."""
    monkeypatch.setenv("TWINSHARD_STARTUP_LIMIT", "0.2")
    started = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(slow_but_steady, 2, 1, timeout=600)
    assert time.monotonic() - started < 30
    assert str(info.value).startswith("start-up limit of 0.2s exceeded: rank(s) 0, 1")
    assert "had not finished starting up" in info.value.failures[0]


def test_bad_hang_timeout_is_a_value_error():
    with pytest.raises(ValueError, match="hang_timeout"):
        launch(slow_but_steady, 1, 1, hang_timeout=0)


# -------------------------------------------------------------------- one run, one owner
_ORPHAN_SCRIPT = """
import os, sys, time
from twinshard.ranks.launch import launch

def rank_sleeps(folder):
    import torch.distributed as dist
    open(os.path.join(folder, f"rank{dist.get_rank()}.pid"), "w").write(str(os.getpid()))
    while True:
        time.sleep(1)

if __name__ == "__main__":
    launch(rank_sleeps, 2, sys.argv[1])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_ranks_die_with_the_launcher(tmp_path, sig):
    script = tmp_path / "orphans.py"
    script.write_text(_ORPHAN_SCRIPT)
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path)])
    try:
        files = [tmp_path / f"rank{r}.pid" for r in (0, 1)]
        assert wait_until(lambda: all(f.exists() and f.read_text() for f in files), 120)
        pids = [int(f.read_text()) for f in files]
        assert all(alive(p) for p in pids)
        parent.send_signal(sig)
        parent.wait(timeout=60)
        assert wait_until(lambda: not any(alive(p) for p in pids), 30), "orphaned ranks"
    finally:
        parent.kill()


def test_a_port_taken_before_the_store_binds_it_is_replaced(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    tried, real = [], launch_module._free_port

    def collide_first():
        port = taken.getsockname()[1] if not tried else real()
        tried.append(port)
        return port

    monkeypatch.setattr(launch_module, "_free_port", collide_first)
    try:
        held = [errno.EADDRINUSE] * 2  # the launcher holds the port for the whole run
        assert launch(bind_master_port, 2) == held
    finally:
        taken.close()
    assert len(tried) == 2 and tried[0] != tried[1]


def test_process_state_sees_a_stopped_process():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert process_state(child.pid) is None
        child.send_signal(signal.SIGSTOP)
        assert wait_until(lambda: process_state(child.pid) is not None, 10)
    finally:
        child.kill()
        child.wait(timeout=10)
