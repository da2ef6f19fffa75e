"""Tests for twinshard.ranks.launch: results, failure handling, deadlines, fork vs a fresh rank."""

import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist

from twinshard.ranks.launch import (
    FRESH,
    LaunchError,
    RankInfo,
    _pick_start_method,
    get_rank_info,
    launch,
)

# Tests of launching itself: their launches start ranks of their own, not the shared worlds'.
pytestmark = pytest.mark.real_launch

# Module-level helpers: spawned children import them from this module by name.


def rank_sum_and_info():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), get_rank_info()


def echo_args(a, b, *, scale=1, tag="none"):
    return (dist.get_rank(), (a + b) * scale, tag, os.environ["WORLD_SIZE"], os.environ["EXTRA"])


def raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy")
    dist.barrier()  # would wait forever: rank 1 never gets here
    return "unreachable"


def exit_on_last_rank():
    if dist.get_rank() == dist.get_world_size() - 1:
        os._exit(3)
    dist.barrier()
    return "unreachable"


def sleep_on_rank_zero(seconds):
    if dist.get_rank() == 0:
        time.sleep(seconds)
    return dist.get_rank()


def big_result():
    rank = dist.get_rank()
    return {"weight": torch.full((1024, 1024), float(rank)), "rank": rank}  # 4 MiB of float32


def thread_count():
    return torch.get_num_threads()


def unpicklable_result():
    return lambda: None


def launched_children() -> list:
    """This process's children, but the ranks of the session's shared worlds (which other
    tests use and which outlive them)."""
    return [
        p for p in multiprocessing.active_children() if not p.name.startswith("twinshard-world")
    ]


def assert_no_children_left():
    deadline = time.monotonic() + 5
    while launched_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert launched_children() == []


# Results and arguments


@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_results_are_ordered_by_rank(nprocs):
    results = launch(rank_sum_and_info, nprocs)  # module-level fn: a fresh rank
    total = float(sum(range(1, nprocs + 1)))
    assert [r[:3] for r in results] == [(rank, nprocs, total) for rank in range(nprocs)]
    assert [r[3] for r in results] == [
        RankInfo(rank, rank, nprocs, "gloo", torch.device("cpu")) for rank in range(nprocs)
    ]
    assert_no_children_left()


def test_args_kwargs_and_env_reach_every_rank():
    results = launch(
        echo_args, 2, 3, 4, scale=10, tag="hi", env={"EXTRA": "x"}, start_method="fork"
    )
    assert results == [(0, 70, "hi", "2", "x"), (1, 70, "hi", "2", "x")]


def test_closure_defined_in_test_runs_with_fork():
    offset = 41

    def add_rank(extra):
        t = torch.ones(1)
        dist.all_reduce(t)
        return dist.get_rank() + offset + extra + int(t.item())

    assert _pick_start_method(add_rank, (), {}, None) == "fork"
    assert _pick_start_method(rank_sum_and_info, (), {}, None) == FRESH == "forkserver"
    assert launch(add_rank, 2, 1) == [44, 45]
    assert launch(lambda: get_rank_info().world_size, 3) == [3, 3, 3]


def test_large_results_come_back_intact():
    results = launch(big_result, 2)
    for rank, result in enumerate(results):
        assert result["rank"] == rank
        assert result["weight"].shape == (1024, 1024)
        assert torch.equal(result["weight"], torch.full((1024, 1024), float(rank)))
    assert_no_children_left()


def test_children_use_one_thread_unless_told_otherwise():
    assert launch(thread_count, 2, start_method="fork") == [1, 1]
    assert launch(thread_count, 1, start_method="fork", env={"TWINSHARD_THREADS": "2"}) == [2]


# Failures


def test_rank_raising_fails_fast_and_kills_blocked_ranks():
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(raise_on_rank_one, 2)  # a fresh rank; default 300 s timeout
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert info.value.ranks == [1]  # rank 0 may fail too, but only as a knock-on effect
    assert message.startswith("launch failed: rank(s) 1")
    assert "ValueError" in message and "rank one is unhappy" in message
    assert "Traceback" in message and "raise_on_rank_one" in message
    assert 1 in info.value.failures and "ValueError" in info.value.failures[1]
    assert isinstance(info.value, RuntimeError)
    assert elapsed < 20, (
        f"took {elapsed:.1f}s; rank 0 was stuck in a barrier and should have been killed"
    )
    assert_no_children_left()


def test_rank_dying_without_exception_reports_exit_code():
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(exit_on_last_rank, 3, start_method="fork")
    assert info.value.ranks == [2]  # ranks 0 and 1 lose their peer and fail after it
    assert str(info.value).startswith("launch failed: rank(s) 2")
    assert "exit code 3" in info.value.failures[2] and "exit code 3" in str(info.value)
    assert time.monotonic() - start < 20
    assert_no_children_left()


def test_deadline_ends_in_launch_error():
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(sleep_on_rank_zero, 2, 60, timeout=1.0, start_method="fork")
    elapsed = time.monotonic() - start
    assert "deadline" in str(info.value)
    assert info.value.ranks == [0]
    assert 0 in info.value.failures and "had not finished" in info.value.failures[0]
    assert 1 not in info.value.failures  # rank 1 finished in time
    assert elapsed < 15
    assert_no_children_left()


def test_unpicklable_result_is_reported():
    with pytest.raises(LaunchError) as info:
        launch(unpicklable_result, 1, start_method="fork")
    assert info.value.ranks == [0]
    assert "pickle" in str(info.value).lower()


# Argument checking


@pytest.mark.parametrize("nprocs", [0, -2, 1.5, True])
def test_bad_nprocs_is_a_value_error(nprocs):
    with pytest.raises(ValueError, match="nprocs"):
        launch(thread_count, nprocs)


@pytest.mark.parametrize("backend", ["carrier-pigeon", ""])
def test_bad_backend_is_a_value_error(backend):
    with pytest.raises(ValueError, match="backend"):
        launch(thread_count, 1, backend=backend)


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="needs a machine without GPUs")
def test_nccl_without_gpus_is_a_value_error():
    with pytest.raises(ValueError, match="nccl|GPU"):
        launch(thread_count, 2, backend="nccl")


def test_forced_spawn_with_closure_is_a_type_error():
    def local():
        return 1

    with pytest.raises(TypeError, match="module-level"):
        launch(local, 1, start_method="spawn")
    with pytest.raises(TypeError, match="module-level"):
        launch(thread_count, 1, lambda: None, start_method="spawn")


def test_bad_timeout_and_start_method_are_value_errors():
    with pytest.raises(ValueError, match="timeout"):
        launch(thread_count, 1, timeout=0)
    with pytest.raises(ValueError, match="start_method"):
        launch(thread_count, 1, start_method="teleport")


def test_refuses_to_run_from_a_process_with_a_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="has not initialized"):
            launch(thread_count, 1)
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


def test_get_rank_info_outside_launch_raises():
    with pytest.raises(RuntimeError, match="launch"):
        get_rank_info()


def test_function_from_a_main_without_file_runs(tmp_path):
    """Like a notebook cell: the function lives in a __main__ that has no file to import."""
    import subprocess
    import sys

    code = (
        "import torch, torch.distributed as dist\n"
        "from twinshard.ranks.launch import launch\n"
        "def cell(x):\n"
        "    t = torch.tensor([float(dist.get_rank() + x)])\n"
        "    dist.all_reduce(t)\n"
        "    return t.item()\n"
        "print(launch(cell, 2, 10))\n"
    )
    out = subprocess.run(
        [sys.executable, "-"], input=code, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[21.0, 21.0]"
