"""Shared rank worlds (``twinshard.ranks.worlds``): a world started once runs many tasks, each as a
launch would run it, and a task cannot leave anything behind for the next.

The tests here use worlds of their own (not the session's): one set shared by the tests that
break nothing, and fresh ones for each test that breaks a world on purpose.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

from twinshard.ranks.launch import LaunchError, get_rank_info, launch
from twinshard.ranks.worlds import Worlds, serving

# Tests of the worlds themselves: their launches are their own.
pytestmark = pytest.mark.real_launch


# Tasks: module-level, so that the ranks import them by name.
def where_am_i(x):
    total = torch.tensor([float(dist.get_rank() + x)])
    dist.all_reduce(total)
    info = get_rank_info()
    return total.item(), info.rank, info.world_size, os.environ.get("GREETING"), os.getpid()


def leave_float64_behind():
    torch.set_default_dtype(torch.float64)
    return str(torch.get_default_dtype())


def default_dtype():
    return str(torch.get_default_dtype())


def wrap_all_reduce():
    real = dist.all_reduce
    dist.all_reduce = lambda *args, **kwargs: real(*args, **kwargs)


def all_reduce_is_torchs():
    return dist.all_reduce is dist.distributed_c10d.all_reduce


def fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one refuses")
    dist.barrier()  # rank 0 waits here for a peer that is gone


def fail_everywhere():
    dist.barrier()
    raise ValueError(f"rank {dist.get_rank()} refuses")


def sleep_past_the_deadline():
    import time

    time.sleep(60)


def post_a_key():
    store = dist.distributed_c10d._get_default_store()
    store.set(f"left-by-{dist.get_rank()}", "1")
    return True


def keys_seen():
    store = dist.distributed_c10d._get_default_store()
    return store.check([f"left-by-{dist.get_rank()}"])


@pytest.fixture(scope="module")
def worlds():
    """Worlds that the tests of this module share: none of them breaks one."""
    found = Worlds()
    yield found
    found.close()


@pytest.fixture
def own_worlds():
    """Worlds for one test, which breaks them on purpose."""
    found = Worlds()
    yield found
    found.close()


def test_a_task_runs_as_launch_runs_it(worlds):
    first = worlds.run(where_am_i, 2, 1, env={"GREETING": "hi"})
    assert [r[:4] for r in first] == [(3.0, 0, 2, "hi"), (3.0, 1, 2, "hi")]
    second = worlds.run(where_am_i, 2, 2)
    assert [r[:4] for r in second] == [(5.0, 0, 2, None), (5.0, 1, 2, None)]  # env is per task
    assert [r[4] for r in first] == [r[4] for r in second]  # the same processes
    assert worlds.started[2] == 1 and worlds.log[-1]["ranks"] == 2


def test_launch_sends_what_a_world_can_serve(worlds):
    tasks = len(worlds.log)
    with serving(worlds):
        assert [r[0] for r in launch(where_am_i, 3, 0)] == [3.0, 3.0, 3.0]
        # a closure cannot be pickled by name: launch forks for it, as it always did
        assert launch(lambda: get_rank_info().world_size, 2) == [2, 2]
    assert worlds.started[3] == 1 and [t["ranks"] for t in worlds.log[tasks:]] == [3]


def test_a_leaked_default_dtype_is_put_back_and_the_task_named(worlds):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert worlds.run(leave_float64_behind, 2) == ["torch.float64"] * 2
    (warning,) = [w for w in caught if "left state behind" in str(w.message)]
    assert "leave_float64_behind" in str(warning.message)
    assert "the default dtype was torch.float64" in str(warning.message)
    assert worlds.run(default_dtype, 2) == ["torch.float32"] * 2  # the next task is clean
    assert worlds.worlds[2].leaks[-1][0].endswith("leave_float64_behind")


def test_a_function_a_task_replaced_is_put_back_and_named(worlds):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        worlds.run(wrap_all_reduce, 2)
    assert any("torch.distributed.all_reduce was replaced" in str(w.message) for w in caught)
    assert worlds.run(all_reduce_is_torchs, 2) == [True, True]


def test_a_task_cannot_read_the_keys_an_earlier_task_posted(worlds):
    assert worlds.run(post_a_key, 2) == [True, True]
    assert worlds.run(keys_seen, 2) == [False, False]


def test_a_task_that_fails_on_one_rank_replaces_the_world(own_worlds):
    pids = [r[4] for r in own_worlds.run(where_am_i, 2, 0)]
    with pytest.raises(LaunchError) as info:
        own_worlds.run(fail_on_rank_one, 2)
    assert str(info.value).startswith(f"task {__name__}.fail_on_rank_one failed: rank(s) 1")
    assert "ValueError: rank one refuses" in str(info.value)
    assert own_worlds.worlds[2].broken
    after = own_worlds.run(where_am_i, 2, 0)
    assert own_worlds.started == {2: 2} and set(pids).isdisjoint(r[4] for r in after)


def test_a_task_that_fails_on_every_rank_keeps_its_world(own_worlds):
    pids = [r[4] for r in own_worlds.run(where_am_i, 2, 0)]
    with pytest.raises(LaunchError) as info:
        own_worlds.run(fail_everywhere, 2)
    assert str(info.value).startswith(f"task {__name__}.fail_everywhere failed: rank(s) ")
    assert info.value.raised == {0, 1}
    assert [r[4] for r in own_worlds.run(where_am_i, 2, 0)] == pids
    assert own_worlds.started == {2: 1}


def test_a_task_past_its_deadline_is_stopped_and_named(own_worlds):
    with pytest.raises(LaunchError) as info:
        own_worlds.run(sleep_past_the_deadline, 2, timeout=2.0)
    assert f"task {__name__}.sleep_past_the_deadline: deadline of 2.0s exceeded" in str(info.value)
    assert [r[0] for r in own_worlds.run(where_am_i, 2, 0)] == [1.0, 1.0]


LEAKY = """
import os, torch
from twinshard.ranks.launch import launch

def pid_and_dtype():
    return os.getpid(), str(torch.get_default_dtype())

def leak():
    torch.set_default_dtype(torch.float64)

def test_leaks():
    launch(leak, 2)

def test_sees_a_clean_rank():
    pid, dtype = launch(pid_and_dtype, 2)[0]
    print("RANK-PID", pid)
    assert dtype == "torch.float32"
"""


@pytest.mark.parametrize("fresh", ["0", "1"])
def test_the_session_shares_its_worlds_unless_told_to_start_fresh_ranks(fresh, tmp_path):
    """Under this suite's own conftest, two tests that launch 2 ranks share them, and the first
    one's leak is named and put back; with ``TWINSHARD_FRESH_RANKS=1`` every launch starts fresh
    ranks, and no task is ever warned about."""
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TWINSHARD_FRESH_RANKS": fresh, "TWINSHARD_TEST_LOGS": str(tmp_path)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tests, env.get("PYTHONPATH")) if p)
    env.pop("COVERAGE_PROCESS_CONFIG", None)
    done = subprocess.run(  # this suite's conftest.py, as a plugin, over one file
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider"]
        + ["test_leaky.py", "-W", "always"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    named = "task test_leaky.leak left state behind" in out
    assert named == (fresh == "0"), out[-3000:]
