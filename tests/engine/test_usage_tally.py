"""The tally of parameters used on some ranks only (issue 23, hazard 1).

It used to all-reduce a host tensor of counts after every backward and read each count back
with ``int(n)``: on a process group with no host backend (``init_process_group("nccl")``) that
fails at the end of the first backward, and on a device it is a host read per parameter. Now
the ranks tally over the store (``twinshard.guard.usage``). Checked here on gloo: a training
step issues no collective of counts and reads no tensor value on the host, a parameter used on
one rank of two is still named (at the next forward; at the end of the backward in debug mode),
every root keeps its own tally, and PyTorch's fake process group trains with the defaults.
``tests/engine/test_unused_on_some_ranks.py`` checks the gradients themselves.
"""

import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from twinshard.ranks.launch import launch

IMPLS = ("twinshard.reference", "twinshard.optimized")


class Branch(torch.nn.Module):
    """``head(left(x))`` on rank 0, ``head(right(x))`` elsewhere when ``split``."""

    def __init__(self, split: bool):
        super().__init__()
        self.left, self.right = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 6)
        self.split = split

    def forward(self, x):
        rank = torch.distributed.get_rank()
        branch = self.right if self.split and rank != 0 else self.left
        return self.head(branch(x))


def _sharded(impl_name: str, split: bool):
    impl = importlib.import_module(impl_name)
    torch.manual_seed(0)
    model = Branch(split)
    impl.fully_shard(model.head)
    impl.fully_shard(model)
    return model


class HostReads(TorchDispatchMode):
    """Counts host reads of tensor values and collectives of integers (counts)."""

    def __init__(self):
        super().__init__()
        self.reads, self.int_collectives = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        if func.namespace == "c10d":
            for a in args:
                for t in a if isinstance(a, (list, tuple)) else [a]:
                    if isinstance(t, torch.Tensor) and not t.is_floating_point():
                        self.int_collectives.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _host_work_of_backward(impl_name: str):
    model = _sharded(impl_name, split=False)
    seen = []
    for _ in range(3):
        loss = model(torch.randn(4, 6)).sum()
        with HostReads() as mode:
            loss.backward()
        seen.append((mode.reads, mode.int_collectives))
    return seen


@pytest.mark.parametrize("impl", IMPLS)
def test_backward_issues_no_collective_of_counts_and_reads_no_value(impl):
    for seen in launch(_host_work_of_backward, 2, impl):
        assert seen == [(0, [])] * 3, seen


def _reported(impl_name: str):
    from twinshard.api import FSDPUsageError

    model = _sharded(impl_name, split=True)
    errors = []
    for _ in range(3):
        try:
            model(torch.randn(4, 6)).sum().backward()
            errors.append(None)
        except FSDPUsageError as e:
            errors.append(str(e))
    # a second root on the same ranks starts a tally of its own: nothing carries over
    clean = _sharded(impl_name, split=False)
    for _ in range(2):
        clean(torch.randn(4, 6)).sum().backward()
    return errors


@pytest.mark.parametrize("debug", [False, True], ids=["at-next-forward", "debug"])
@pytest.mark.parametrize("impl", IMPLS)
def test_parameter_used_on_some_ranks_is_named(impl, debug):
    env = {"TWINSHARD_DEBUG": "1"} if debug else {}
    for errors in launch(_reported, 2, impl, env=env):
        # debug: at the end of every backward; else at the forward after a backward: the
        # second iteration's forward names the first backward, the third runs (nothing is
        # unsettled after an error), ...
        named = [0, 1, 2] if debug else [1]
        assert [i for i, e in enumerate(errors) if e is not None] == named, errors
        for message in (errors[i] for i in named):
            for part in ("'left.weight' (1 of 2 ranks)", "'right.bias' (1 of 2 ranks)"):
                assert part in message, message
            assert "set_reduce_scatter_unused_params(True)" in message


def test_fake_process_group_trains_with_the_defaults():
    """``init_process_group("fake", store=FakeStore())``, as torch's tests and dry runs use
    it: the model fingerprint and the tally have nobody to ask and stay out of the way."""
    import subprocess
    import sys

    code = """
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import twinshard.optimized as O, twinshard.reference as R
from twinshard.models import MLPStack
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
for impl in (R, O):
    model = MLPStack(dim=8, hidden=16, n_blocks=2)
    for block in model.blocks:
        impl.fully_shard(block)
    impl.fully_shard(model)
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
print("trained")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "trained" in done.stdout, done.stderr[-3000:]


class GetThenSetStore:
    """A key-value store whose ``append`` is a get and a set, as c10d's default (FileStore's).
    ``interleave`` runs once, at the first write: between an append's get and set, or before a
    set, where another rank's post can land."""

    def __init__(self):
        self.data, self.interleave = {}, None

    def add(self, key, amount):
        self.data[key] = str(int(self.data.get(key, b"0")) + amount).encode()
        return int(self.data[key])

    def set(self, key, value):
        self.run_interleave()
        self.data[key] = value.encode() if isinstance(value, str) else value

    def run_interleave(self):
        if self.interleave is not None:
            run, self.interleave = self.interleave, None
            run()

    def get(self, key):
        return self.data[key]

    def delete_key(self, key):
        return self.data.pop(key, None) is not None

    def append(self, key, value):
        old = self.data.get(key, b"")
        self.run_interleave()
        self.set(key, old + value.encode())


def test_two_ranks_posting_at_once_both_count(monkeypatch):
    """Both ranks left 'w' unused in the same backward: fine, nothing to report. Posted at the
    same moment through a store whose append is a get and a set, the code before per-rank keys
    lost one list and reported 'w' as used on 1 of 2 ranks (the false report PyTorch's FSDP2
    tests met with init_method='file://')."""
    from twinshard.guard import usage

    monkeypatch.setattr(usage.dist, "get_rank", lambda: 0)
    store = GetThenSetStore()
    rank0, rank1 = usage._Ranks(store, (0, 1), 0), usage._Ranks(store, (0, 1), 0)
    store.interleave = lambda: rank1.post(["w"])
    rank0.post(["w"])
    assert rank0.read(0) == ([], {"w"})  # unused everywhere: fine
    rank0.post(["w", "b"])  # backward 1: 'b' unused on rank 0 only
    rank1.post(["w"])
    assert rank0.read(1) == ([("b", 1)], {"w"})
    assert not [k for k in store.data if k.startswith(rank0.key(0, ""))]  # backward 0 deleted
