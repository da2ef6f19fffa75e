"""The optimized path's schedule, as named event lists (hook by hook, collective by collective).

Each group's hooks and collectives are wrapped to log ``(event, group)``; one training step
(the second: the first records the order of the groups) is compared with the expected list
as a whole, so a change of order anywhere shows as a diff. The optimized path issues the next
group's all-gather inside the current group's pre-forward / pre-backward (one group ahead)
and reduces each group's gradients one group later; the reference does everything in place.
"""

import torch

from twinshard.ranks.launch import launch

HOOKS = ("pre_forward", "post_forward", "pre_backward", "post_backward")


def _events(impl_name: str, n_blocks: int = 3) -> list[tuple[str, str]]:
    import importlib

    from twinshard.models import MLPStack
    from twinshard.reference.state import get_state

    impl = importlib.import_module(impl_name)
    torch.manual_seed(0)
    model = MLPStack(dim=15, hidden=37, n_blocks=n_blocks)
    for block in model.blocks:
        impl.fully_shard(block)
    impl.fully_shard(model)
    events: list[tuple[str, str]] = []

    def log(group, method, label, name, only_if=lambda: True):
        original = getattr(group, method)

        def logged(*args, **kwargs):
            if only_if():
                events.append((label, name))
            return original(*args, **kwargs)

        setattr(group, method, logged)

    for name, module in model.named_modules():
        state = get_state(module)
        if state is None or state.group is None:
            continue
        group, name = state.group, name or "root"
        gathered = lambda g=group: all(p.state.name == "UNSHARDED" for p in g.params)  # noqa: E731
        for hook in HOOKS:
            log(group, hook, hook, name)
        log(group, "reduce_grads_now", "reduce-scatter", name)
        # a reshard is an event when there is something to free or to finish
        log(
            group,
            "reshard",
            "reshard",
            name,
            lambda g=group, f=gathered: f() or getattr(g, "in_flight", None) is not None,
        )
        if hasattr(group, "unshard_async"):  # the optimized path splits unshard in two
            log(
                group,
                "unshard_async",
                "all-gather",
                name,
                lambda g=group, f=gathered: g.in_flight is None and not f(),
            )
            log(group, "wait_for_unshard", "wait", name, lambda g=group: g.in_flight is not None)
        else:
            log(group, "unshard", "all-gather", name, lambda f=gathered: not f())
    x = torch.randn(4, 15)
    model(x).sum().backward()  # the first step records the order of the groups
    events.clear()
    model(x).sum().backward()
    return events


OPTIMIZED = [
    # forward: every group's pre-forward, the root's too, issues its all-gather, prefetches
    # the next group's (the reference's ``while_gathering`` seam) and then waits for its own
    ("pre_forward", "root"),
    ("all-gather", "root"),
    ("all-gather", "blocks.0"),
    ("wait", "root"),
    ("pre_forward", "blocks.0"),
    ("all-gather", "blocks.1"),
    ("wait", "blocks.0"),
    ("post_forward", "blocks.0"),
    ("reshard", "blocks.0"),
    ("pre_forward", "blocks.1"),
    ("all-gather", "blocks.2"),
    ("wait", "blocks.1"),
    ("post_forward", "blocks.1"),
    ("reshard", "blocks.1"),
    ("pre_forward", "blocks.2"),
    ("wait", "blocks.2"),
    ("post_forward", "blocks.2"),
    ("reshard", "blocks.2"),
    ("post_forward", "root"),  # the root keeps its parameters for backward
    # backward: the root finished forward last, so it runs first and prefetches blocks.2
    ("pre_backward", "root"),
    ("all-gather", "blocks.2"),
    ("pre_backward", "blocks.2"),
    ("wait", "blocks.2"),
    ("all-gather", "blocks.1"),
    ("post_backward", "blocks.2"),
    ("reshard", "blocks.2"),
    ("reduce-scatter", "blocks.2"),
    ("pre_backward", "blocks.1"),
    ("wait", "blocks.1"),
    ("all-gather", "blocks.0"),
    ("post_backward", "blocks.1"),
    ("reshard", "blocks.1"),
    ("reduce-scatter", "blocks.1"),
    ("pre_backward", "blocks.0"),
    ("wait", "blocks.0"),
    # the inputs of the root and of blocks.0 need no gradient: their post-backward runs in
    # the final callback, in the order fully_shard registered them
    ("post_backward", "root"),
    ("reshard", "root"),
    ("reduce-scatter", "root"),
    ("post_backward", "blocks.0"),
    ("reshard", "blocks.0"),
    ("reduce-scatter", "blocks.0"),
]


def test_optimized_prefetches_one_group_ahead():
    events = launch(_events, 2, "twinshard.optimized")[0]
    assert events == OPTIMIZED, "\n".join(map(str, events))


def test_reference_does_everything_in_place():
    events = launch(_events, 2, "twinshard.reference")[0]
    expected = [
        ("pre_forward", "root"),
        ("all-gather", "root"),
        ("pre_forward", "blocks.0"),
        ("all-gather", "blocks.0"),
        ("post_forward", "blocks.0"),
        ("reshard", "blocks.0"),
        ("pre_forward", "blocks.1"),
        ("all-gather", "blocks.1"),
        ("post_forward", "blocks.1"),
        ("reshard", "blocks.1"),
        ("pre_forward", "blocks.2"),
        ("all-gather", "blocks.2"),
        ("post_forward", "blocks.2"),
        ("reshard", "blocks.2"),
        ("post_forward", "root"),
        ("pre_backward", "root"),
        ("pre_backward", "blocks.2"),
        ("all-gather", "blocks.2"),
        ("post_backward", "blocks.2"),
        ("reshard", "blocks.2"),
        ("reduce-scatter", "blocks.2"),
        ("pre_backward", "blocks.1"),
        ("all-gather", "blocks.1"),
        ("post_backward", "blocks.1"),
        ("reshard", "blocks.1"),
        ("reduce-scatter", "blocks.1"),
        ("pre_backward", "blocks.0"),
        ("all-gather", "blocks.0"),
        ("post_backward", "root"),
        ("reshard", "root"),
        ("reduce-scatter", "root"),
        ("post_backward", "blocks.0"),
        ("reshard", "blocks.0"),
        ("reduce-scatter", "blocks.0"),
    ]
    assert events == expected, "\n".join(map(str, events))


def _skip_a_block_on_the_second_step():
    import twinshard.optimized as O
    from twinshard.models import MLPStack

    torch.manual_seed(0)
    model = MLPStack(dim=15, hidden=37, n_blocks=3)
    for block in model.blocks:
        O.fully_shard(block)
    O.fully_shard(model)
    x = torch.randn(4, 15)
    model(x).sum().backward()  # the order is now root, blocks 0, 1, 2
    last = model.blocks[2]
    model.blocks = model.blocks[:2]  # the next forward ends after block 1
    try:
        out = model(x)
    finally:
        model.blocks.append(last)
    # block 1 prefetched block 2 from the recorded order; nobody used it: the root's
    # post-forward finished and freed it, so it is sharded again and nothing is in flight
    from torch.distributed.tensor import DTensor

    from twinshard.reference.state import get_state

    left = get_state(last).group
    return left.in_flight is None, isinstance(last.w1.weight, DTensor), out.shape


def test_an_unused_prefetch_is_finished_and_freed_after_forward():
    nothing_in_flight, sharded, shape = launch(_skip_a_block_on_the_second_step, 2)[0]
    assert nothing_in_flight and sharded and tuple(shape) == (4, 15)


def _unshard_a_module_without_parameters():
    import torch.nn as nn

    import twinshard.optimized as O

    torch.manual_seed(0)
    inner = nn.Linear(6, 6)
    outer = nn.Sequential(inner)  # all its parameters belong to the sharded child
    O.fully_shard(inner)
    O.fully_shard(outer)
    handle = outer.unshard(async_op=True)
    handle.wait()
    return outer.unshard(), type(handle).__name__, outer(torch.randn(2, 6)).shape


def test_unshard_of_a_module_without_parameters_of_its_own():
    blocking, handle, shape = launch(_unshard_a_module_without_parameters, 2)[0]
    assert blocking is None and handle == "UnshardHandle" and tuple(shape) == (2, 6)
