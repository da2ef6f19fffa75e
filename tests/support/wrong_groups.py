"""Wrong answers to tutorial 12's exercise (a parameter group's four hooks), each a mistake a
student makes, for tests/docs/test_exercise_group.py: the answer's group with one hook changed.
``WRONG`` maps each to the case that must fail and words its explanation must hold.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from twinshard.reference.collectives import all_gather_rows, reduce_scatter_rows

_path = Path(__file__).parents[2] / "tutorials" / "answers" / "12_exercise_param_group.py"
_spec = importlib.util.spec_from_file_location("group_answer", _path)
answer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(answer)
MyGroup = answer.MyGroup


class GathersAgain(MyGroup):
    """Gathers every parameter again, even one kept unsharded since forward."""

    def unshard_param(self, p, dtype):
        group = p.all_gather_mesh(self.post_forward_info).shard_group
        for block, out in zip(p.all_gather_inputs(dtype), p.all_gather_outputs(dtype)):
            all_gather_rows(out, block, group)
        p.finish_unshard()


class SumNotMean(MyGroup):
    """Adds the reduced sum to the gradient without dividing it into the mean."""

    def gradient_divisors(self, dtype, info):
        return None, 1


def _post_backward_with(group, **flags):
    """The answer's post_backward, with ``flags`` set on ``group`` while it runs."""
    wanted = {name: getattr(group, name) for name in flags}
    vars(group).update(flags)
    try:
        MyGroup.post_backward(group)
    finally:
        vars(group).update(wanted)


class ReducesEveryMicroBatch(MyGroup):
    """Reduces after every backward, ignoring set_requires_gradient_sync(False)."""

    def post_backward(self):
        _post_backward_with(self, reduce_grads=True)


class KeepsWeightsAfterBackward(MyGroup):
    """Never frees the unsharded weights after backward."""

    def post_backward(self):
        _post_backward_with(self, reshard_after_backward=False)


class NoReplicaSum(MyGroup):
    """HSDP: sums over the shard group only, never across the replicas."""

    def reduce_param(self, p, dtype):
        used, grad = p.has_grad_to_reduce, p.reduce_scatter_input(dtype)
        if grad is None:
            return None
        block = reduce_scatter_rows(grad.to(dtype), p.info.shard_group)
        p.accumulate_grad(block / self.gradient_divisors(dtype, p.info)[1])
        return used


# wrong group -> (mesh, case that must fail, words its explanation must hold)
WRONG = {
    GathersAgain: ("2", "reshard_false", "was gathered again"),
    SumNotMean: ("2", "per_block", "what is communicated is right"),
    ReducesEveryMicroBatch: ("2", "cost_no_sync", "the contract asks for none"),
    KeepsWeightsAfterBackward: ("2", "per_block", "put the sharded parameters back"),
    NoReplicaSum: ("2x2", "cost_default", "all_reduce: none"),
}
