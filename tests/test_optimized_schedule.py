"""The optimized path's schedule: the next group's all-gather is issued before the current
group computes (forward and backward), and no more than two blocks are unsharded at once."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from twinshard.conformance.trace import CollectiveTrace
from twinshard.launch import launch
from twinshard.models import MLPStack


def _schedule(impl_name):
    import importlib
    impl = importlib.import_module(impl_name)
    torch.manual_seed(0)
    model = MLPStack(dim=15, hidden=37, n_blocks=4)
    for block in model.blocks:
        impl.fully_shard(block)
    impl.fully_shard(model)
    x = torch.randn(4, 15)
    model(x).sum().backward()  # the first step records the order of the groups
    seen = {"forward": [], "backward": [], "unsharded": []}
    trace = CollectiveTrace()

    def unsharded_blocks():
        return sum(not isinstance(b.w1.weight, DTensor) for b in model.blocks)

    def note(kind, i):
        seen[kind].append((i, len(trace.calls)))
        seen["unsharded"].append(unsharded_blocks())  # hooks must return None

    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: note("forward", i))
        block.w1.register_full_backward_pre_hook(lambda m, g, i=i: note("backward", i))
    with trace:
        model(x).sum().backward()
    gathers = [k for k, c in enumerate(trace.calls) if c.op == "all_gather"]
    return seen, gathers, [c.op for c in trace.calls]


def test_optimized_prefetches_one_group_ahead():
    seen, gathers, ops = launch(_schedule, 2, "twinshard.optimized")[0]
    # forward: when block i starts computing, the gathers issued so far include block i+1's
    # (root first, then one per block: block i's gather is number i + 1)
    for i, issued in seen["forward"][:-1]:
        done = sum(1 for g in gathers if g < issued)
        assert done >= i + 3, (i, issued, gathers, ops)
    # backward: block i's backward starts with block i-1's gather already issued
    for i, issued in seen["backward"]:
        if i > 0:
            done = sum(1 for g in gathers if g < issued)
            assert done >= 1 + 4 + (4 - i) + 1, (i, issued, gathers, ops)
    assert max(seen["unsharded"]) <= 2, seen["unsharded"]


def test_reference_does_not_prefetch():
    seen, gathers, ops = launch(_schedule, 2, "twinshard.reference")[0]
    per_block = 6  # the reference gathers each of a block's 6 parameters separately
    for i, issued in seen["forward"]:
        done = sum(1 for g in gathers if g < issued)
        assert done == 4 + (i + 1) * per_block, (i, issued)  # root's 4, then this block's own
    assert max(seen["unsharded"]) <= 1
