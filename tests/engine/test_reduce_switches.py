"""torch's reduction switches, real in the optimized path: ``set_force_sum_reduction_for_comms``
and ``set_reduce_scatter_max_input_buffers`` ([Note: the mean on the wire] in
``optimized/reduction.py``, [Note: reductions in flight] in ``optimized/flat_group.py``).

Two gloo ranks train two steps of a small model. The reduce op each collective was given is
read off ``torch.distributed`` as the collectives are issued, the reductions in flight off
the shared context at every group's post-backward, and the gradients are compared bit for
bit with the default settings and with the reference (with two ranks every division is exact,
so the mean taken by the collectives is the reference's sum divided by two). The schedule
runs on stand-in streams under their checks, so holding more reductions in flight is checked
for order and buffer lifetimes as well.
"""

import pytest
import torch

from twinshard.ranks.launch import launch

STANDIN = {"TWINSHARD_STANDIN_STREAMS": "1"}


def _train(impl_name: str, force_sum: bool, buffers: int):
    import importlib

    import torch.distributed as dist

    from twinshard.dispatch.standin import standin_streams
    from twinshard.models import MLPStack

    impl = importlib.import_module(impl_name)
    ops, in_flight = [], []
    originals = {name: getattr(dist, name) for name in ("all_reduce", "reduce_scatter_tensor")}

    def spy(name):
        def collective(*args, **kwargs):
            ops.append(str(kwargs.get("op")))
            return originals[name](*args, **kwargs)

        return collective

    for name in originals:
        setattr(dist, name, spy(name))
    finish = None
    try:
        torch.manual_seed(0)
        model = MLPStack(dim=16, hidden=24, n_blocks=4)
        for block in model.blocks:
            impl.fully_shard(block)
        impl.fully_shard(model)
        for module in (*model.blocks, model):
            module.set_force_sum_reduction_for_comms(force_sum)
        model.set_reduce_scatter_max_input_buffers(buffers)
        if impl_name == "twinshard.optimized":
            from twinshard.optimized import flat_group

            finish = flat_group.finish_reduce

            def watched(comm, keep=0):
                in_flight.append(len(comm.pending_reduce))
                finish(comm, keep)
                in_flight.append(len(comm.pending_reduce))

            flat_group.finish_reduce = watched
        torch.manual_seed(1 + dist.get_rank())
        with standin_streams().checking():
            for _ in range(2):
                model(torch.randn(8, 16)).sum().backward()
        grads = [p.grad.to_local().clone() for p in model.parameters()]
    finally:  # the rank may run other tasks after this one (twinshard.ranks.worlds)
        for name, fn in originals.items():
            setattr(dist, name, fn)
        if finish is not None:
            flat_group.finish_reduce = finish
    return grads, sorted(set(ops)), max(in_flight, default=0)


def _run(impl: str, force_sum: bool = False, buffers: int = 1):
    return launch(_train, 2, impl, force_sum, buffers, env=STANDIN)


def _same(a: list, b: list) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)


@pytest.fixture(scope="module")
def default_run():
    return _run("twinshard.optimized")


def test_the_collectives_take_the_mean_unless_told_to_sum(default_run):
    summed = _run("twinshard.optimized", force_sum=True)
    reference = _run("twinshard.reference")
    for rank in range(2):
        grads, ops, _ = default_run[rank]
        assert ops == [str(torch.distributed.ReduceOp.AVG)], ops
        assert summed[rank][1] == [str(torch.distributed.ReduceOp.SUM)], summed[rank][1]
        assert _same(grads, summed[rank][0])
        assert _same(grads, reference[rank][0])


def test_more_reductions_in_flight_change_no_gradient(default_run):
    two = _run("twinshard.optimized", buffers=2)
    for rank in range(2):
        grads, _, in_flight = default_run[rank]
        assert in_flight == 1, in_flight  # the previous group's, finished at the next one
        assert two[rank][2] == 2, two[rank][2]  # two groups' reductions waited on together
        assert _same(grads, two[rank][0])


def _separate_group_after_a_new_default_group():
    """Train with a separate reduce-scatter group, make a new default process group (as a
    script that calls destroy_process_group and init_process_group again does), and train a new
    model the same way: the group of the first default group is gone, a new one is made."""
    import torch.distributed as dist

    from twinshard.models import MLPStack
    from twinshard.optimized import fully_shard

    def train() -> list:
        torch.manual_seed(0)
        model = MLPStack(dim=8, hidden=8, n_blocks=2)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        model.set_separate_reduce_scatter_group(True)
        torch.manual_seed(1 + dist.get_rank())
        model(torch.randn(4, 8)).sum().backward()
        return [p.grad.to_local().clone() for p in model.parameters()]

    first = train()
    store, rank, size = dist.distributed_c10d._get_default_store(), dist.get_rank(), 2
    dist.destroy_process_group()
    again = dist.PrefixStore("a-new-default-group", store)
    dist.init_process_group("gloo", store=again, rank=rank, world_size=size)
    same = _same(first, train())
    from twinshard.optimized.flat_group import SEPARATE_GROUPS

    worlds = {world is dist.group.WORLD for world, _ in SEPARATE_GROUPS.values()}
    return same, worlds  # the first default group's separate group was dropped


def test_a_separate_reduce_scatter_group_survives_a_new_default_group():
    assert launch(_separate_group_after_a_new_default_group, 2) == [(True, {True})] * 2
