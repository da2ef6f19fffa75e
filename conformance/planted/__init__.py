"""Implementations with a planted bug, for checking that the suite catches each one.

Each submodule is the reference with one thing broken, exposed through the same interface:

    scaled_grads   every reduced gradient is scaled by 1.001
    dropped_grad   one parameter's gradient is never reduced (it stays None)
    shifted_shard  every rank's initial shard starts one row too late
    bf16_reduce    gradients are reduced in bf16 when the policy asks for fp32

``twinshard conform twinshard.conformance.planted.scaled_grads`` must fail; the test suite
asserts that it does, case by case. The bugs are planted per object (by swapping the class
of the reference's own parameter and group objects), so the reference itself stays intact
in the same process.
"""

from __future__ import annotations

from twinshard.reference import fully_shard as reference_fully_shard
from twinshard.reference.state import get_state


def plant(bug_param_class=None, bug_group_class=None, which=lambda params: params, after=None):
    """A ``fully_shard`` that calls the reference and then swaps in the buggy classes
    (or, with ``after``, damages the freshly sharded parameters)."""
    def fully_shard(module, **kwargs):
        module = reference_fully_shard(module, **kwargs)
        group = get_state(module).group
        if group is not None:
            if bug_group_class is not None:
                group.__class__ = bug_group_class
            if bug_param_class is not None:
                for p in which(group.params):
                    p.__class__ = bug_param_class
            if after is not None:
                after(group)
        return module
    return fully_shard
