"""The gradient pack with mixed precision (issue 33, item 1): bf16 gradients are cast as they
are packed into the fp32 reduce-scatter buffer, and accumulated without a reduction as they
are, into an fp32 sum. Both implementations give torch's ``fully_shard``'s gradients to the
bit, with a parameter no rank used (zeros of the reduce dtype beside bf16 gradients in one
pack) and over two micro-batches with ``set_requires_gradient_sync(False)`` on the first.
"""

import pytest
import torch

from twinshard.ranks.launch import launch

IMPLS = ("twinshard.reference", "twinshard.optimized", "torch.distributed.fsdp")


class TwoHeads(torch.nn.Module):
    """``used`` computes; ``unused`` never does, so no rank has a gradient for it."""

    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(8, 6)
        self.unused = torch.nn.Linear(8, 6)

    def forward(self, x):
        return self.used(x).square().sum()


def _grads(micro_batches: int) -> dict:
    """Per implementation: this rank's sharded gradients after ``micro_batches`` backwards, the
    last one reduced."""
    import importlib

    import torch.distributed as dist

    out = {}
    for name in IMPLS:
        impl = importlib.import_module(name)
        torch.manual_seed(0)
        model = TwoHeads()
        policy = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        impl.fully_shard(model, mp_policy=policy)
        g = torch.Generator().manual_seed(dist.get_rank())
        for k in range(micro_batches):
            model.set_requires_gradient_sync(k == micro_batches - 1)
            model(torch.randn(5, 8, generator=g)).backward()
        out[name] = {
            n: None if p.grad is None else p.grad.to_local().clone()
            for n, p in model.named_parameters()
        }
    return out


@pytest.fixture(scope="module")
def ranks() -> dict:
    return {k: launch(_grads, 2, k) for k in (1, 2)}


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_mixed_precision_gradients_equal_torchs_to_the_bit(ranks, micro_batches):
    for grads in ranks[micro_batches]:
        theirs = grads["torch.distributed.fsdp"]
        assert theirs["unused.weight"] is None  # no rank used it: no gradient anywhere
        assert theirs["used.weight"].dtype == torch.float32
        for name in IMPLS[:2]:
            mine = grads[name]
            assert mine.keys() == theirs.keys()
            for param, grad in theirs.items():
                if grad is None:
                    assert mine[param] is None, (name, param)
                else:
                    assert torch.equal(mine[param], grad), (name, param)
