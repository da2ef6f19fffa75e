"""Implementations with a planted bug, for checking that the suite catches each one.

Each submodule is an implementation with one thing broken, exposed through the same interface.
Planted in the reference:

    scaled_grads      every reduced gradient is scaled by 1.001
    dropped_grad      one parameter's gradient is never reduced (it stays None)
    shifted_shard     every rank's initial shard starts one row too late
    bf16_reduce       gradients are reduced in bf16 when the policy asks for fp32

Planted in the optimized path (the first three show only on stand-in streams, where the
suite and the fuzzer check the stream order: run them with ``--stand-in-streams``):

    optimized_no_wait          a group computes without waiting for its all-gather and copy-out
    optimized_early_release    the all-gather buffer is released before its copy-out
    optimized_event_only       the copy-in waits only on the post-optimizer event, though the
                               compute stream wrote shards after it (caught by the sanitized
                               fuzzer's assign-loads)
    optimized_dropped_partial  HSDP: the partial sums of earlier micro-batches are dropped
    optimized_wrong_prefetch   a group computes with the all-gather prefetched for another
    optimized_scaled_grads     scaled_grads's parameter class in the optimized path: a bug in
                               a contract method of ``ShardedParam`` reaches both trees
    optimized_prefetch_races_edits  a prefetch's copy-in can be overtaken by a write to the
                               shards on the current stream (stand-in streams show it)
    optimized_prefetch_misses_edits  an implicit prefetch's group computes with the shards
                               it read before an edit made at the group's own pre-forward
    optimized_moves_shards_late  a shard moves into new memory at its first all-gather (and
                               after ``module.to``, ``assign=True`` loads): views and state
                               dicts taken earlier go stale, values stay right
    optimized_drops_grads_at_pack  the unreduced gradients are released when their pack is
                               queued on the reduce-scatter stream, before it read them
                               (stand-in streams show it)

Planted in communication variants (``lossy.py``: broken subclasses of ``twinshard.variants``'
qwZ and qgZ, not implementations; ``tests/variants/test_variants_planted.py`` asserts that the exact
oracle of the variant each claims to be catches it): wrong_scale, drops_partial_block,
blocks_shift_by_rank, int8_sends_bf16, sums_without_dividing.

Planted in the reference's parameter group for tutorial 13 (``group_bugs.py``: one line of
``ParamGroup``'s four hooks changed, drawn by a seed; ``tests/docs/test_exercise_bug.py``):
gathers_kept_params, replicas_summed_over_shards, partial_sums_ignored, mean_over_shards,
sync_flags_swapped.

Planted costs: the values stay right, only what is communicated or kept alive is not (the
``cost_*`` cases catch them, ``tests/suite/test_cost_contract.py`` asserts it):

    syncs_every_micro_batch            set_requires_gradient_sync(False) is ignored: every
                                       micro-batch reduce-scatters (and its optimized_ twin)
    all_reduces_every_micro_batch      HSDP: set_requires_all_reduce(False) is ignored
    gathers_fp32                       param_dtype bf16: all-gathered in fp32, cast after
    gathers_in_backward                set_unshard_in_backward(False) is ignored
    reshards_kept                      what reshard_after_forward=False keeps is resharded
                                       after forward and gathered again in backward
    keeps_grad_buffers                 each padded gradient stays alive after its reduction
    optimized_prefetch_all             every group still to run is prefetched at once
    reshards_after_backward            set_reshard_after_backward(False) is ignored
    keeps_after_forward                no group is resharded after forward
    reduces_fp32                       bf16 parameters: gradients reduced in fp32 anyway
    in_pieces_gathered_early           the root in pieces: a parent prefetches its pieces at
                                       its own pre-forward, not where each piece is next

``twinshard conform twinshard.conformance.planted.scaled_grads`` must fail; the test suite
asserts that it does, case by case. The bugs are planted per object (by swapping the class
of the implementation's own parameter, group or state objects), so the implementations
themselves stay intact in the same process.
"""

from __future__ import annotations

from twinshard.reference import fully_shard as reference_fully_shard
from twinshard.reference.state import get_state


def plant(
    bug_param_class=None,
    bug_group_class=None,
    which=lambda params: params,
    after=None,
    bug_state_class=None,
    base=reference_fully_shard,
):
    """A ``fully_shard`` that calls ``base`` (the reference's by default) and then swaps in the
    buggy classes (or, with ``after``, damages the freshly sharded parameters)."""

    def fully_shard(module, **kwargs):
        module = base(module, **kwargs)
        state = get_state(module)
        if bug_state_class is not None:
            state.__class__ = bug_state_class
        group = state.group
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


def ignored(value):
    """A property that always reads ``value`` and drops every assignment: a setting the user
    changes (``set_requires_gradient_sync(False)``, ...) that the implementation never sees."""
    return property(lambda self: value, lambda self, new: None)
