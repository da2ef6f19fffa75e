"""Wrong answers to tutorial 11's exercise (the ring all-gather), each a mistake a student makes,
for tests/docs/test_exercise_ring.py: ``WRONG`` maps each to words its grading must say. Most
are the answer's ring with one part changed (``ring``); the deadlocking one is written out,
since its grading names the line it is stuck on.
"""

from __future__ import annotations

import torch.distributed as dist


def ring(
    shard, group, steps=None, global_ranks=True, own=True, fill=None, me=None, sends_own=False
):
    """The answer's ring with its parts as arguments: ``steps`` steps (S - 1), to its
    neighbours' global ranks (``global_ranks=False``: their group ranks, as if global);
    ``own`` places this rank's shard in its row first; the rows start as ``fill`` (None:
    uninitialized); ``me`` is the row index this rank counts from (its group rank);
    ``sends_own``: it sends its own shard at every step, not the row it received last."""
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    right, left = (rank + 1) % size, (rank - 1) % size
    if global_ranks:
        right, left = dist.get_global_rank(group, right), dist.get_global_rank(group, left)
    me = rank if me is None else me
    shape = (size, *shard.shape)
    rows = shard.new_empty(shape) if fill is None else shard.new_full(shape, fill)
    if own:
        rows[me % size] = shard
    for step in range(size - 1 if steps is None else steps):
        sent = shard if sends_own else rows[(me - step) % size]
        sending = dist.isend(sent, right, group=group)
        dist.recv(rows[(me - step - 1) % size], left, group=group)
        sending.wait()
    return rows


def own_shard_every_step(shard, group):
    """Sends its own shard at every step, not what it received: right at 2 ranks only."""
    return ring(shard, group, sends_own=True)


def one_step(shard, group):
    """Stops after the first step: right at 2 ranks only."""
    return ring(shard, group, steps=1, fill=0.0)


def group_ranks_as_global(shard, group):
    """Sends to group ranks as if they were global ones: right wherever the two agree."""
    return ring(shard, group, global_ranks=False)


def rows_by_global_rank(shard, group):
    """Counts rows from its global rank, not its group rank: right in the whole world only."""
    return ring(shard, group, me=dist.get_rank())


def own_shard_never_placed(shard, group):
    """Never puts its own shard in its row: it forwards a row it never wrote."""
    return ring(shard, group, own=False, fill=float("nan"))


def every_row_added_to(shard, group):
    """Adds each received shard to its own: every row a running sum."""
    rows = ring(shard, group)
    return rows + rows[dist.get_rank(group)]


def flat(shard, group):
    """Returns the rows flattened, (S * n,): the layout of torch's all-gather output."""
    return ring(shard, group).reshape(-1)


def blocking_send_first(shard, group):
    """Every rank sends with a blocking send before it receives: each waits for the next."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    right = dist.get_global_rank(group, (me + 1) % size)
    left = dist.get_global_rank(group, (me - 1) % size)
    rows = shard.new_empty((size, *shard.shape))
    rows[me] = shard
    for step in range(size - 1):
        dist.send(rows[(me - step) % size], right, group=group)
        dist.recv(rows[(me - step - 1) % size], left, group=group)
    return rows


WRONG = {
    one_step: "never arrived",
    group_ranks_as_global: "a group rank used as a global one",
    rows_by_global_rank: "rows are shifted by 1",
    own_shard_every_step: "holds rank 2's shard, not rank 1's",
    own_shard_never_placed: "was never written",
    every_row_added_to: "adds nothing",
    flat: "returned shape",
    blocking_send_first: "deadlock",
}
