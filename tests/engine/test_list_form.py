"""``fully_shard([norm, head])``: one group of two modules is gathered once per pass.

The group's post-backward is planted on the inputs of its first module to run forward only,
as torch 2.13 plants it, so that it runs once the whole group's backward is done. Planted on
every module's inputs, the head's post-backward resharded the group before the norm's backward,
which gathered it a second time. Counted here by the unshards of ``norm.weight`` in the
reference and the optimized path (``finish_unshard``, or the group-level ``finish_unshard_all``); the values are the conformance case ``list_form``'s.
"""

import pytest
import torch

from twinshard.ranks.launch import launch


def _unshards_per_pass(impl_name: str) -> list:
    import importlib

    from twinshard.models import MLPStack
    from twinshard.reference.sharded_param import ShardedParam

    impl = importlib.import_module(impl_name)
    counts, finish, inside = [], ShardedParam.finish_unshard, []
    finish_all = ShardedParam.finish_unshard_all  # the group-level method, which calls
    # ``finish_unshard`` itself for a parameter of another layout: counted once either way

    def counted(self):
        if self.fqn == "norm.weight" and not inside:
            counts[-1] += 1
        return finish(self)

    def counted_all(params):
        counts[-1] += sum(p.fqn == "norm.weight" for p in params)
        inside.append(True)
        try:
            return finish_all(params)
        finally:
            inside.pop()

    ShardedParam.finish_unshard = counted
    ShardedParam.finish_unshard_all = staticmethod(counted_all)
    torch.manual_seed(0)
    model = MLPStack(dim=15, hidden=37, n_blocks=2)
    for block in model.blocks:
        impl.fully_shard(block)
    impl.fully_shard([model.norm, model.head])
    impl.fully_shard(model)
    for _ in range(2):
        counts.append(0)
        out = model(torch.randn(4, 15))
        counts.append(0)
        out.sum().backward()
    return counts


@pytest.mark.parametrize("impl", ["twinshard.reference", "twinshard.optimized"])
def test_a_group_of_two_modules_is_gathered_once_per_pass(impl):
    assert launch(_unshards_per_pass, 2, impl)[0] == [1, 1, 1, 1]  # forward, backward, twice
