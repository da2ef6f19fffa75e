"""The contract's group-level methods (``reference/more/group.py``) do what the per-parameter
methods they name do, parameter by parameter.

On 2 gloo ranks two copies of one model are sharded by the reference: a weight whose rows
divide over the ranks, one whose rows leave padding, a bias, and a ``Shard(1)`` weight (a
layout of the second reading, which the group-level methods hand to its own methods). One copy
is moved through the contract's per-parameter methods, the other through the group-level ones,
over two steps (the second finds gradients to add to and outputs allocated already); after
every move both copies must agree on each parameter's state, what its module holds, the
unsharded values, the memory freed and the sharded gradients, to the bit.
"""

import torch

from twinshard.ranks.launch import launch


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 3), torch.nn.Linear(3, 8))


def _moved(group_level: bool) -> list:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    import twinshard.reference as R
    from twinshard.reference.sharded_param import ShardedParam
    from twinshard.reference.state import get_state

    model = _model()
    last = model[2].weight  # (8, 3): cut along its columns, a layout of the second reading
    R.fully_shard(model, shard_placement_fn=lambda p: Shard(1) if p is last else None)
    group = get_state(model).group
    params, dtypes = group.params, group.param_dtypes(group.params)
    seen = []

    def look(label):
        for p in params:
            held = p.held
            seen.append((label, p.fqn, p.state.name, held is p.unsharded_param))
            if p.state.name == "UNSHARDED":
                seen.append((label, p.fqn, held.detach().clone()))
            else:
                seen.append((label, p.fqn, p.all_gather_storage.nbytes()))
            grad = p.sharded_param.grad
            seen.append((label, p.fqn, None if grad is None else grad.to_local().clone()))

    for step in range(2):
        inputs = [p.all_gather_inputs(d) for p, d in zip(params, dtypes)]
        if group_level:
            outs = ShardedParam.all_gather_outputs_all(params, dtypes)
        else:
            outs = [o for p, d in zip(params, dtypes) for o in p.all_gather_outputs(d)]
        for (block,), out in zip(inputs, outs, strict=True):
            dist.all_gather_into_tensor(out, block.contiguous())
        if group_level:
            ShardedParam.finish_unshard_all(params)
        else:
            for p in params:
                p.finish_unshard()
        look(f"unsharded {step}")
        for p in params:  # a gradient as autograd would leave it, different on each rank
            grad = torch.arange(p.unsharded_param.numel(), dtype=torch.float32) * (step + 1)
            p.unsharded_param.grad = (grad + dist.get_rank()).view(p.unsharded_param.shape)
            p.take_grad(torch.float32)
        if group_level:
            used, full = ShardedParam.reduce_scatter_inputs(params, torch.float32)
        else:
            used = [p.has_grad_to_reduce for p in params]
            full = [p.reduce_scatter_input(torch.float32) for p in params]
        assert used == [True] * len(params)
        blocks = []
        for p, grad in zip(params, full):  # (S * chunk, *rest) -> (chunk, *rest), the mean
            block = grad.new_empty((p.chunk, *grad.shape[1:]))
            dist.reduce_scatter_tensor(block, grad)
            blocks.append(block / 2)
        if group_level:
            ShardedParam.accumulate_grads(params, blocks)
            ShardedParam.reshard_all(params)
        else:
            for p, block in zip(params, blocks):
                p.accumulate_grad(block)
            for p in params:
                p.reshard()
        look(f"resharded {step}")
    return seen


def _both() -> tuple[list, list]:
    return _moved(False), _moved(True)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def test_group_level_methods_move_a_group_as_the_per_parameter_ones_do():
    for per_parameter, group_level in launch(_both, 2):
        assert len(per_parameter) == len(group_level) > 0
        for a, b in zip(per_parameter, group_level, strict=True):
            assert all(_same(x, y) for x, y in zip(a, b, strict=True)), (a[:2], a[2:], b[2:])
        states = {row[2] for row in group_level if len(row) == 4}
        assert states == {"UNSHARDED", "SHARDED"}, states  # both moves were taken
        freed = [r[2] for r in group_level if r[0].startswith("resharded") and type(r[2]) is int]
        assert freed and set(freed) == {0}  # the unsharded memory was given back
