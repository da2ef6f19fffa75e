"""The collective guard (``twinshard.guard``) on ranks that disagree, for both implementations.

Each case runs on 2 gloo ranks and makes them disagree the way users do by accident: a module
that runs on one rank only, a model built differently on one rank, one rank running one more
step. Without the guard these abort inside gloo or hang until the backend's timeout; with it,
``launch`` raises ``LaunchError`` carrying each rank's ``GuardError``, which names the
parameter and the step. The launcher's timeout (``TIMEOUT``) is the time bound: a guard that
failed to report would surface as the launcher's "deadline exceeded" instead, and fail here.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from twinshard import guard
from twinshard.guard import channel
from twinshard.models import MLPStack
from twinshard.ranks.launch import LaunchError, launch

IMPLS = ["twinshard.reference", "twinshard.optimized"]
TORCH = "torch.distributed.fsdp"  # calls no guard itself: checked from outside
TIMEOUT = 40  # the launcher's deadline; the guard must report well within it
DEBUG = {guard.ENV: "1", guard.TIMEOUT_ENV: "4"}


class Branchy(MLPStack):
    """An MLP with one more sharded module, ``extra``, that forward runs only where asked."""

    def __init__(self, extra_on: tuple = (0, 1), **kwargs):
        super().__init__(dim=15, hidden=37, n_blocks=2, **kwargs)
        self.extra = nn.Linear(15, 15)
        self.extra_on = extra_on

    def forward(self, x):
        for block in self.blocks:
            x = block(x)  # (B, 15)
        if dist.get_rank() in self.extra_on:
            x = self.extra(x)  # (B, 15)
        return self.head(self.norm(x))  # (B, 15)


def _train(impl_name: str, steps: dict, hidden: dict | None = None, extra_on=(0, 1)) -> str:
    """Shard a ``Branchy`` (blocks, extra, root) and train ``steps[rank]`` steps."""
    impl = importlib.import_module(impl_name)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Branchy(extra_on=extra_on)
    if hidden and rank in hidden:  # this rank builds a wider first block
        model.blocks[0].w1 = nn.Linear(15, hidden[rank])
        model.blocks[0].w2 = nn.Linear(hidden[rank], 15)
    for block in model.blocks:
        impl.fully_shard(block)
    impl.fully_shard(model.extra)
    impl.fully_shard(model)
    watching = contextlib.nullcontext()
    if impl_name == TORCH:
        guard.check_model(model)
        watching = guard.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watching:
        for _ in range(steps[rank]):
            model(torch.randn(4, 15)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return "done"


def _failures(env: dict, *args, **kwargs) -> dict[int, str]:
    with pytest.raises(LaunchError) as caught:
        launch(_train, 2, *args, timeout=TIMEOUT, env=env, **kwargs)
    assert "deadline" not in str(caught.value), "the guard did not report; the launcher did"
    return caught.value.failures


@pytest.mark.parametrize("impl", [*IMPLS, TORCH])
def test_agreeing_ranks_pass_the_debug_checks(impl):
    assert launch(_train, 2, impl, {0: 3, 1: 3}, timeout=TIMEOUT, env=DEBUG) == ["done"] * 2


@pytest.mark.parametrize("impl", IMPLS)
def test_module_used_on_one_rank_only(impl):
    failures = _failures(DEBUG, impl, {0: 2, 1: 2}, extra_on=(0,))
    assert sorted(failures) == [0, 1], "both ranks must report"
    for text in failures.values():
        head = text.split("\n\n")[0]
        assert head.startswith("twinshard.guard.GuardError"), head
        assert "'extra.weight'" in head and "step 0" in head, head
        assert "rank 0: all_gather of 'extra.weight'" in head, head
        assert "rank 1: all_gather of 'blocks.1." in head, head  # already in backward


@pytest.mark.parametrize("debug", [False, True], ids=["default", "debug"])
@pytest.mark.parametrize("impl", [*IMPLS, TORCH])
def test_model_built_differently_on_one_rank(impl, debug):
    failures = _failures(DEBUG if debug else {}, impl, {0: 1, 1: 1}, hidden={1: 38})
    assert sorted(failures) == [0, 1], "both ranks must report"
    for text in failures.values():
        head = text.split("\n\n")[0]
        assert head.startswith("twinshard.guard.GuardError"), head
        assert "differs across ranks" in head, head
        assert "rank(s) [0]: param blocks.0.w1.weight: (37, 15)" in head, head
        assert "rank(s) [1]: param blocks.0.w1.weight: (38, 15)" in head, head


def test_torch_module_used_on_one_rank_only():
    """Around torch's fully_shard, ``guard.watch`` checks from the dispatcher: no names."""
    failures = _failures(DEBUG, TORCH, {0: 2, 1: 2}, extra_on=(0,))
    assert sorted(failures) == [0, 1], "both ranks must report"
    for text in failures.values():
        head = text.split("\n\n")[0]
        assert head.startswith("twinshard.guard.GuardError"), head
        assert "rank 0 is in all_gather (forward), rank 1 in all_gather (backward)" in head, head


@pytest.mark.parametrize("impl", IMPLS)
def test_one_rank_runs_an_extra_step(impl):
    failures = _failures(DEBUG, impl, {0: 3, 1: 2})
    head = failures[0].split("\n\n")[0]
    assert head.startswith("twinshard.guard.GuardError"), head
    assert "rank(s) [1] did not reach collective" in head, head
    assert "all_gather of 'norm.weight'" in head and "at step 2 (forward)" in head, head
    assert "at step 1 (backward)" in head, head  # the last one both ranks reached
    # Rank 1 finished its steps and waits in the launcher's teardown barrier, outside every
    # check: it cannot report, and fails only once rank 0 is gone.
    assert 1 not in failures or "GuardError" not in failures[1]


def _param_names(impl_name: str) -> tuple[list[str], list[str]]:
    """(the names the guard and error messages use, the module's own parameter names)."""
    impl = importlib.import_module(impl_name)
    model = MLPStack(dim=7, hidden=5, n_blocks=2)
    for block in model.blocks:
        impl.fully_shard(block)
    impl.fully_shard(model)
    model(torch.randn(2, 7))
    used = []
    for module in model.modules():
        state = module.__dict__.get("_twinshard_state")
        if state is not None and state.group is not None:
            used += [p.fqn for p in state.group.params]
    return sorted(used), sorted(n for n, _ in model.named_parameters())


@pytest.mark.parametrize("impl", IMPLS)
def test_parameters_are_named_by_their_full_path(impl):
    used, real = launch(_param_names, 1, impl, timeout=TIMEOUT)[0]
    assert "blocks.1.w1.weight" in used and "norm.weight" in used, used
    assert used == real


def test_train_debug_flag_turns_the_checks_on(monkeypatch, tmp_path):
    """``twinshard train --debug`` sets TWINSHARD_DEBUG before anything else (here the run
    stops at a bad flag right after), so every rank it starts inherits it."""
    from twinshard.train.cli import main

    monkeypatch.setenv(guard.ENV, "0")  # monkeypatch restores the variable after the test
    monkeypatch.delenv(guard.ENV)
    assert main(["--debug", "--steps", "0", "--out", str(tmp_path / "run")]) == 2
    assert os.environ.get(guard.ENV) == "1"


def _wait_for_a_peer_that_stops() -> list:
    """Rank 1 waits for a key rank 0 never posts; rank 0 gives up with a message instead."""
    store, rank, seen = channel.connection(), dist.get_rank(), []
    if rank == 0:
        time.sleep(0.5)
        with pytest.raises(guard.GuardError):
            channel.give_up(store, "rank 0 found a difference")
    else:
        try:
            seen.append(channel.exchange(store, "t/a", (0, 1), "x", time.monotonic() + 20))
        except guard.GuardError as e:
            seen.append(str(e))
    dist.barrier()
    if rank == 1:  # the message is old news for a new wait: it runs to its deadline
        seen.append(channel.exchange(store, "t/b", (0, 1), "x", time.monotonic() + 1))
    return seen


def test_a_waiting_rank_stops_with_its_peers_message():
    """A rank waiting in one check stops with the message another rank left, long before its
    own deadline (20 s here, the launcher's is 40 s), and only with a message left after it
    began to wait."""
    _, seen = launch(_wait_for_a_peer_that_stops, 2, timeout=TIMEOUT)
    assert seen == ["rank 0 found a difference", ({}, [0])]


def test_a_custom_collective_is_named_alike_on_every_rank():
    """Debug mode compares collectives by name; a custom reduce-scatter hook is an object
    whose repr holds its address, so it is named by its class (the same on every rank)."""
    from twinshard.conformance.cases.comm_hooks import CountingReduceScatter
    from twinshard.dispatch.c10d import kind

    a, b = CountingReduceScatter(), CountingReduceScatter()
    assert kind(a) == kind(b) == "CountingReduceScatter"
    assert kind(dist.reduce_scatter_tensor) == "reduce_scatter"
