"""twinshard.ranks.launch and the accelerator (issue 23, hazard 8): an accelerator rank gets its
device and joins its group with ``device_id``; no rank is forked once this process has
initialized the accelerator's runtime.

As in ``test_devices.py``, ``cuda`` is named the accelerator by monkeypatching the accelerator
API, and a backend registered for ``cuda`` only stands in for NCCL. Forked ranks inherit the
patches, which is why the run below forks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_devices import ACCEL_BACKEND, name_cuda_as_the_accelerator

from twinshard.ranks import devices
from twinshard.ranks.launch import RankInfo, _pick_start_method, get_rank_info, launch

# Tests of launching itself: their launches start ranks of their own, not the shared worlds'.
pytestmark = pytest.mark.real_launch


def module_level_fn():
    return dist.get_rank()


def where_am_i():
    world = dist.group.WORLD
    return get_rank_info(), world.bound_device_id, devices.rank_device_type()


def test_an_accelerator_rank_gets_its_device_and_device_id(monkeypatch):
    name_cuda_as_the_accelerator(monkeypatch, count=2)
    results = launch(where_am_i, 2, backend=ACCEL_BACKEND, start_method="fork", timeout=60)
    for rank, (info, bound, kind) in enumerate(results):
        assert info == RankInfo(rank, rank, 2, ACCEL_BACKEND, torch.device("cuda", rank))
        assert bound == torch.device("cuda", rank)  # init_process_group(device_id=...)
        assert kind == "cuda"


def test_too_few_devices_for_an_accelerator_backend_is_a_value_error(monkeypatch):
    name_cuda_as_the_accelerator(monkeypatch, count=1)
    with pytest.raises(ValueError, match=f"{ACCEL_BACKEND}.*one cuda device"):
        launch(module_level_fn, 2, backend=ACCEL_BACKEND)


# ------------------------------------------------------------- no fork after the runtime starts
@pytest.fixture
def cuda_initialized(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)


def test_module_level_function_starts_fresh_after_cuda_init(cuda_initialized):
    # a fresh rank: spawned, or forked from the fork server, which never touched a device
    assert _pick_start_method(module_level_fn, (), {}, None) in ("forkserver", "spawn")


def test_closure_after_cuda_init_is_refused_naming_it(cuda_initialized):
    def local_step():
        return 1

    with pytest.raises(RuntimeError) as info:
        launch(local_step, 2)
    message = str(info.value)
    assert "local_step" in message and "cuda" in message
    assert "module-level function" in message  # what to do
    with pytest.raises(RuntimeError, match="<lambda>.*cuda"):
        _pick_start_method(lambda: None, (), {}, None)


def test_forced_fork_after_cuda_init_is_refused(cuda_initialized):
    with pytest.raises(RuntimeError, match="start_method='fork'.*cuda"):
        _pick_start_method(module_level_fn, (), {}, "fork")


def test_unpicklable_arguments_after_cuda_init_are_refused(cuda_initialized):
    with pytest.raises(RuntimeError, match="pickled.*cuda"):
        _pick_start_method(module_level_fn, (lambda: None,), {}, None)


def test_another_accelerator_s_runtime_counts_too(monkeypatch):
    monkeypatch.setattr(
        torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("xpu")
    )
    monkeypatch.setattr(torch.xpu, "is_initialized", lambda: True)
    assert devices.initialized_accelerator() == "xpu"
    with pytest.raises(RuntimeError, match="xpu"):
        _pick_start_method(lambda: None, (), {}, None)


def test_fork_is_still_chosen_before_any_runtime_starts():
    assert devices.initialized_accelerator() is None
    assert _pick_start_method(lambda: None, (), {}, None) == "fork"
