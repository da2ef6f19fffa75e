"""Wrong answers to tutorial 10's exercise (the ring reduce-scatter), each a mistake a student
makes, for tests/docs/test_exercise_ring.py: ``WRONG`` maps each to words its grading must say.
Most are the answer's ring with one part changed (``ring``); the deadlocking one is written out,
since its grading names the line it is stuck on.
"""

from __future__ import annotations

import torch.distributed as dist


def ring(chunks, group, first=1, own=2, steps=None, global_ranks=True):
    """The answer's ring with its parts as arguments: it starts from this rank's row of chunk
    me - ``first``, at step k adds its row of chunk me - k - ``own``, runs ``steps`` steps
    (S - 1), and sends to its neighbours' global ranks (``global_ranks=False``: their group
    ranks, as if they were global)."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    right, left = (me + 1) % size, (me - 1) % size
    if global_ranks:
        right, left = dist.get_global_rank(group, right), dist.get_global_rank(group, left)
    partial, received = chunks[(me - first) % size].clone(), chunks[0].clone()
    for step in range(size - 1 if steps is None else steps):
        sending = dist.isend(partial, right, group=group)
        dist.recv(received, left, group=group)
        sending.wait()
        partial = received + chunks[(me - step - own) % size]
    return partial


def off_by_one(chunks, group):
    """Adds its own row of the chunk it sent, not of the one it received."""
    return ring(chunks, group, own=1)


def neighbours_block(chunks, group):
    """Starts from its own row of its own chunk: the ring ends one block along."""
    return ring(chunks, group, first=0, own=1)


def one_step(chunks, group):
    """Stops after the first step: right at 2 ranks only."""
    return ring(chunks, group, steps=1)


def group_ranks_as_global(chunks, group):
    """Sends to group ranks as if they were global ones: right wherever the two agree."""
    return ring(chunks, group, global_ranks=False)


def own_row_twice(chunks, group):
    """Adds its own row at the end once more."""
    return ring(chunks, group) + chunks[dist.get_rank(group)]


def whole_input(chunks, group):
    """Reduces every chunk and returns them all: the shape of an all-reduce."""
    total = chunks.clone()
    dist.all_reduce(total, group=group)
    return total


def blocking_send_first(chunks, group):
    """Every rank sends with a blocking send before it receives: each waits for the next."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    right = dist.get_global_rank(group, (me + 1) % size)
    left = dist.get_global_rank(group, (me - 1) % size)
    partial, received = chunks[(me - 1) % size].clone(), chunks[0].clone()
    for step in range(size - 1):
        dist.send(partial, right, group=group)
        dist.recv(received, left, group=group)
        partial = received + chunks[(me - step - 2) % size]
    return partial


WRONG = {
    off_by_one: "block 0 is missing",
    neighbours_block: "returned block 1's sum, not block 0's",
    one_step: "partial sum",
    group_ranks_as_global: "a group rank used as a global one",
    blocking_send_first: "deadlock",
    whole_input: "returned shape",
    own_row_twice: "row 2 times",
}
