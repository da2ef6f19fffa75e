"""The device a rank computes on comes from the accelerator API, never from the backend's name
(issue 23, hazard 2), and an accelerator rank joins its group with ``device_id`` (hazard 8).

This CPU build has no accelerator, so the tests make one the way a machine would show it:
``torch.accelerator.current_accelerator()`` is monkeypatched to name ``cuda``, and a process
group backend registered for ``cuda`` only (PyTorch's fake process group behind it) stands in
for NCCL. The decision itself (a mesh type, a ``device_id``) is then what a GPU machine gets.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch
import torch.distributed as dist

from twinshard.conformance.cases import Context
from twinshard.ranks import devices
from twinshard.reference.mesh import default_mesh
from twinshard.train import cli as train_cli

# DeviceMesh guesses a current device when none was set; the guess is not what is tested here.
pytestmark = pytest.mark.filterwarnings("ignore:It seems like you did not set")
ROOT = pathlib.Path(__file__).resolve().parents[2]
ACCEL_BACKEND = "tsaccelonly"  # runs on the accelerator only, as nccl does


def _fake_group(common, options):
    from torch._C._distributed_c10d import FakeProcessGroup

    return FakeProcessGroup._create_internal(common.group_rank, common.group_size, options)


if ACCEL_BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(ACCEL_BACKEND, _fake_group, extended_api=True, devices=["cuda"])


def name_cuda_as_the_accelerator(monkeypatch, count: int = 2) -> None:
    """Make this process look like a machine with ``count`` CUDA devices to the APIs asked."""
    monkeypatch.setattr(
        torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda")
    )
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what older code asked
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)


@pytest.fixture
def group():
    """``group(backend)`` joins a one-rank default group; it is destroyed after the test."""

    def join(backend: str) -> None:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)

    yield join
    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------ hazard 2: the default mesh
@pytest.mark.parametrize("backend", [f"cpu:gloo,cuda:{ACCEL_BACKEND}", ACCEL_BACKEND])
def test_default_mesh_is_on_the_accelerator_the_api_names(monkeypatch, group, backend):
    name_cuda_as_the_accelerator(monkeypatch)
    group(backend)  # "cpu:gloo,cuda:nccl" or "nccl" on a GPU machine: neither is named "nccl"
    assert default_mesh().device_type == "cuda"
    assert devices.rank_device() == torch.device("cuda", 0)


def test_default_mesh_stays_on_the_cpu_where_the_group_cannot_reach_the_accelerator(
    monkeypatch, group
):
    name_cuda_as_the_accelerator(monkeypatch)
    group("cpu:gloo")
    assert default_mesh().device_type == "cpu"


def test_without_an_accelerator_the_mesh_is_on_the_cpu(group):
    group(f"cpu:gloo,cuda:{ACCEL_BACKEND}")
    assert torch.accelerator.current_accelerator(check_available=True) is None
    assert default_mesh().device_type == "cpu"


def test_a_group_bound_to_a_device_decides(monkeypatch, group):
    group("gloo")
    monkeypatch.setattr(dist.group.WORLD, "bound_device_id", torch.device("cuda", 1), raising=False)
    assert devices.rank_device_type() == "cuda"


def test_conformance_context_follows_the_device_it_is_told(monkeypatch, group):
    name_cuda_as_the_accelerator(monkeypatch)
    group(f"cpu:gloo,cuda:{ACCEL_BACKEND}")
    told_nothing = Context(None, "x", None, (1,), "")
    assert told_nothing.device_type == "cuda"  # the accelerator API, not the backend's name
    told_cpu = Context(None, "x", None, (1,), "", device_choice="cpu")  # --device cpu
    assert told_cpu.device_type == "cpu" and told_cpu.device == torch.device("cpu")


def test_no_device_is_decided_from_a_backend_name():
    """The old test (``"cuda" if dist.get_backend() == "nccl" else "cpu"``) in any form."""
    pattern = re.compile(r"""(get_backend\(\)|backend)\s*[!=]=\s*["']nccl["']""")
    folders = ("reference", "optimized", "conformance", "twinshard")
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for folder in folders
        for path in sorted((ROOT / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, "decide the device with twinshard.ranks.devices:\n" + "\n".join(found)


# ------------------------------------------------------------ hazard 8: device_id, the backend
@pytest.mark.parametrize(
    "backend, device",
    [
        ("nccl", torch.device("cuda", 1)),
        ("cpu:gloo,cuda:nccl", torch.device("cuda", 1)),
        ("xccl", torch.device("xpu", 1)),
        (ACCEL_BACKEND, torch.device("cuda", 1)),
        ("gloo", None),
        ("cpu:gloo", None),
    ],
)
def test_an_accelerator_rank_joins_with_its_device_id(backend, device):
    expected = {"backend": backend} if device is None else {"backend": backend, "device_id": device}
    assert devices.init_args(backend, 1) == expected
    assert devices.backend_device(backend, 1) == (device or torch.device("cpu"))


def test_torchrun_rank_binds_its_accelerator(monkeypatch):
    """``twinshard train`` under torchrun on a 2-GPU machine: rank 1 joins nccl on cuda:1."""
    name_cuda_as_the_accelerator(monkeypatch)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(devices, "_group_device", None)
    current, joined = [], []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)

    class Joined(Exception):
        pass

    def init_process_group(*args, **kwargs):
        joined.append((args, kwargs))
        raise Joined  # enough: the rank has asked to join

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    with pytest.raises(Joined):
        train_cli._run_torchrun(cfg=None)
    ((args, kwargs),) = joined
    assert (args[0] if args else kwargs["backend"]) == "nccl"
    assert kwargs["device_id"] == torch.device("cuda", 1)
    assert current == [1]


def test_the_machine_s_accelerator_backend(monkeypatch):
    assert devices.accelerator_backend(1) is None and devices.accelerator_count() == 0
    name_cuda_as_the_accelerator(monkeypatch, count=2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert devices.accelerator_backend(2) == "nccl" and devices.accelerator_count() == 2
    assert devices.accelerator_backend(3) is None  # one device per rank, or the CPU
    monkeypatch.setattr(
        torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("mps")
    )
    assert devices.accelerator_backend(1) is None  # its default backend is gloo, a host one
    assert devices.accelerator_count() == 0


def test_collectives_return_when_queued_on_an_accelerator_backend(monkeypatch, group):
    assert not devices.collectives_return_when_queued()  # no group yet
    name_cuda_as_the_accelerator(monkeypatch)
    group(f"cpu:gloo,cuda:{ACCEL_BACKEND}")
    assert devices.collectives_return_when_queued()  # like nccl on cuda
    dist.destroy_process_group()
    group("cpu:gloo")
    assert not devices.collectives_return_when_queued()  # gloo on the CPU: done on return
