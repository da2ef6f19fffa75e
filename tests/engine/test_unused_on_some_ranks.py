"""Parameters used on some ranks only (issue 34, item 2), on 2 gloo ranks.

Rank 0 routes through ``left``, rank 1 through ``right``; ``spare`` is used by no rank. Before,
after one backward rank 0 held a gradient of ``left`` and rank 1 none, so the next collective
over the gradients (``full_tensor()``, a norm for clipping) hung, and the misuse was named only
at the next backward. Now, checked for both implementations, with and without
``set_reduce_scatter_unused_params(True)``:

- after the backward every rank holds a gradient of ``left`` and ``right`` (or none does), each
  equal to what torch's ``fully_shard`` gives with the switch (the sum with zeros from the rank
  that did not use it), and ``spare`` has none without the switch, as torch leaves it;
- without the switch the next optimizer step, or else the next forward, raises
  ``FSDPUsageError`` on both ranks naming ``left`` and ``right``; with it, nothing is raised and
  the step equals torch's;
- the backward reads no tensor value on the host.
"""

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from twinshard.commandline import impls
from twinshard.ranks.launch import launch

IMPLS = ("twinshard.reference", "twinshard.optimized")
ROUTED = ("left.weight", "left.bias", "right.weight", "right.bias")


class Routed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.shared, self.left, self.right = (torch.nn.Linear(6, 6) for _ in range(3))
        self.spare, self.head = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)

    def forward(self, x):
        branch = self.left if dist.get_rank() == 0 else self.right
        return self.head(branch(self.shared(x)))


class ValueReads(TorchDispatchMode):
    """Counts host reads of tensor values."""

    reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def _sharded(impl_name: str, switch: bool):
    impl = impls.load(impl_name)  # reference, optimized, torch or a module's name
    torch.manual_seed(0)
    model = Routed()
    impl.fully_shard(model.head)
    impl.fully_shard(model)
    if switch:
        model.set_reduce_scatter_unused_params(True)
    return model


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * dist.get_rank() + step))


def _one_step(impl_name: str, switch: bool) -> dict:
    from twinshard.api import FSDPUsageError

    model = _sharded(impl_name, switch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(_batch(0)).sum()
    with ValueReads() as reads:
        loss.backward()
    has = {name: p.grad is not None for name, p in model.named_parameters()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, has)  # compare before any collective over the gradients
    out = {"reads": reads.reads, "has": every, "grads": {}, "step_error": None}
    if any(h != every[0] for h in every):
        return out  # inconsistent: a collective over the gradients would hang
    out["grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters() if has[n]}
    try:
        opt.step()
    except FSDPUsageError as e:
        out["step_error"] = str(e)
    out["params"] = {n: p.full_tensor() for n, p in model.named_parameters()}
    # no optimizer this time: the next forward names it
    model(_batch(1)).sum().backward()
    try:
        model(_batch(2))
        out["forward_error"] = None
    except FSDPUsageError as e:
        out["forward_error"] = str(e)
    return out


@pytest.fixture(scope="module")
def torchs():
    return launch(_one_step, 2, "torch", True)


@pytest.mark.parametrize("switch", [False, True], ids=["undeclared", "declared"])
@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_of_routed_parameters_are_consistent_and_exact(impl, switch, torchs):
    for rank, (ours, theirs) in enumerate(zip(launch(_one_step, 2, impl, switch), torchs)):
        assert ours["reads"] == 0, ours["reads"]
        assert all(h == ours["has"][0] for h in ours["has"]), ours["has"]
        expected_names = set(theirs["grads"]) - (
            set() if switch else {"spare.weight", "spare.bias"}
        )
        assert set(ours["grads"]) == expected_names, (rank, sorted(ours["grads"]))
        for name in expected_names:
            assert torch.equal(ours["grads"][name], theirs["grads"][name]), name
        for name in ROUTED:  # the sums are not zero: both ranks' inputs reached them
            assert ours["grads"][name].abs().sum() > 0, name
        if switch:
            assert ours["step_error"] is None and ours["forward_error"] is None
            for name, value in theirs["params"].items():
                assert torch.equal(ours["params"][name], value), name
        else:
            for message in (ours["step_error"], ours["forward_error"]):
                assert message is not None, ours
                assert "'left.weight' (1 of 2 ranks)" in message, message
                assert "'right.bias' (1 of 2 ranks)" in message, message
                assert "set_reduce_scatter_unused_params(True)" in message, message
                assert "spare" not in message, message
