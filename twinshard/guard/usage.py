"""Which ranks used which parameters, tallied over the job's store.

After a backward that reduced gradients every rank knows, on its own, which trainable parameters
it had no gradient for (``reference/more/usage.py`` says why that matters). Telling the others must
cost no collective and read no device value: an all-reduce of host counts fails outright where
the process group has no host backend (``init_process_group("nccl")``), and one of device counts
would need a host read of the result, a synchronization in every step. So the ranks tally over
the key-value store that every ``torch.distributed`` job has:

- at the end of backward n each rank adds ``1 + K * has_unused`` to the counter of backward n
  (``K`` is one more than the number of ranks, so the sum holds both counts), after writing
  the names of its unused parameters (none, almost always) under a key of its own (numbered
  by one more ``add``: a store's ``append`` is a get and a set in several stores, such as
  the ``FileStore`` of ``init_method="file://"``, and two ranks appending at once lose one
  list); the rank whose addition completes the count writes the tally, how many ranks had
  unused parameters;
- every rank reads the tally of backward n before it posts backward n + 1 (``Posted.read``;
  ``unused_grads`` says when: at the end of backward n on a rank that needs it for its
  gradients, else at the root's next forward or optimizer step), and the lowest rank, reading
  it, deletes the keys of backward n - 1, which every rank has read by then.

One store round trip to post, one to read; a list is fetched only when some rank had unused
parameters. A rank that reads at the end of its backward waits there for the slowest rank to
post; one that reads at the next forward has almost always no wait. In debug mode
(``TWINSHARD_DEBUG=1``) every rank reads at the end of the backward, so the error comes there;
every rank then waits for the slowest, as the debug checks of every collective do anyway.
Nothing is tallied without a store to share (one process playing every rank, as with PyTorch's
fake process group) or with one rank.
"""

from __future__ import annotations

import itertools
import json
import os
import weakref

import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily

from twinshard.dispatch.c10d import exchanges_values

from . import channel

PREFIX = "twinshard-usage"


class _Ranks:
    """The tally of one root on one set of ranks: how many backwards it posted, the store."""

    def __init__(self, store, ranks: tuple, root: int):
        self.store, self.ranks = store, ranks
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # keys of a fresh attempt
        self.base = f"{PREFIX}/{attempt}/{root}/{'-'.join(map(str, ranks))}"
        self.posted = 0  # backwards posted so far; the next one is number ``posted``
        self.lists = {}  # backward number -> how many ranks posted a list there (once read)

    def key(self, n: int, what: str) -> str:
        return f"{self.base}/{n}/{what}"

    def post(self, unused: list[str]) -> int:
        """Post this rank's unused parameters for the next backward; returns its number."""
        n, world = self.posted, len(self.ranks)
        if unused:  # a key of its own: see the module's docstring
            i = self.store.add(self.key(n, "lists"), 1)
            self.store.set(self.key(n, f"unused/{i}"), json.dumps(unused))
        total = self.store.add(self.key(n, "count"), 1 + (world + 1) * bool(unused))
        if total % (world + 1) == world:  # the last rank to post writes the tally
            self.store.set(self.key(n, "tally"), str(total // (world + 1)))
        self.posted += 1
        return n

    def read(self, n: int) -> tuple[list[tuple[str, int]], set[str]]:
        """The parameters of backward ``n`` that some ranks used and others did not, with the
        number of ranks that used them, and those that no rank used; waits (up to the store's
        timeout) for every rank to post."""
        world = len(self.ranks)
        try:
            ranks_with_unused = int(self.store.get(self.key(n, "tally")))
            lists = [
                self.store.get(self.key(n, f"unused/{i}")) for i in range(1, ranks_with_unused + 1)
            ]
        except Exception as e:  # noqa: BLE001 - the store's own timeout or connection error
            raise RuntimeError(
                f"twinshard: the ranks {list(self.ranks)} did not all finish backward {n} in time "
                f"to tally which parameters they used ({type(e).__name__}: {e}); a rank stopped "
                "or fell far behind"
            ) from e
        self.lists[n] = ranks_with_unused
        previous_lists = self.lists.pop(n - 1, 0)
        if dist.get_rank() == min(self.ranks) and n >= 1:
            listed = [f"unused/{i}" for i in range(1, previous_lists + 1)]
            for what in ("count", "tally", "lists", *listed):
                self.store.delete_key(self.key(n - 1, what))
        unused_on: dict[str, int] = {}
        for names in lists:
            for name in json.loads(names):
                unused_on[name] = unused_on.get(name, 0) + 1
        partly = [(name, world - k) for name, k in unused_on.items() if k < world]
        return partly, {name for name, k in unused_on.items() if k == world}


# per root (an object the caller keeps, such as its FSDP state): its number, the same on every
# rank because every rank runs its roots' first backwards in the same order, and its tallies
_roots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_root_count = itertools.count()


_ranks_of: dict[int, tuple] = {}  # id(mesh) -> (mesh, its ranks in order)


def mesh_ranks(mesh) -> tuple:
    """The global ranks of a ``DeviceMesh``, in order (read once per mesh). Read on the host
    with any ``FakeTensorMode`` set aside: under one (torch's fake process group and a memory
    estimator's fake mode) the mesh's rank tensor would come out fake, its values unreadable."""
    hit = _ranks_of.get(id(mesh))
    if hit is None or hit[0] is not mesh:
        with unset_fake_temporarily():
            hit = _ranks_of[id(mesh)] = (mesh, tuple(mesh.mesh.flatten().tolist()))
    return hit[1]


class Posted:
    """One rank's post of one backward on one set of ranks; ``read`` fetches that backward's
    tally once (waiting for every rank to post) and keeps it."""

    def __init__(self, tally: _Ranks, n: int):
        self.tally, self.n, self.result = tally, n, None

    def read(self) -> tuple[list[tuple[str, int]], set[str]]:
        """(the parameters some ranks used and others did not, each with the number that used
        it; the names no rank used)."""
        if self.result is None:
            self.result = self.tally.read(self.n)
        return self.result


def post_unused(root, mesh, unused: list[str]) -> Posted | None:
    """Post the names of this rank's trainable parameters that got no gradient in this
    backward of ``root`` on ``mesh`` (a ``DeviceMesh``). Returns the post, whose ``read`` gives
    the backward's tally, or None where there is nobody to tally with (one rank, or no store
    to share: one process playing every rank, where what one rank left unused all did)."""
    store = tally_connection()
    if store is None or mesh.size() == 1 or not exchanges_values(mesh.get_group(0)):
        return None
    ranks = mesh_ranks(mesh)
    if root not in _roots:
        _roots[root] = (next(_root_count), {})
    number, tallies = _roots[root]
    tally = tallies.get(ranks)
    if tally is None or tally.store is not store:
        tally = tallies[ranks] = _Ranks(store, ranks, number)
    return Posted(tally, tally.post(unused))


_connection: tuple | None = None  # (the guard's connection, the tally's own)


def tally_connection():
    """A connection to the job's store for the tally, or None where the guard has nobody to ask.
    Its own, with the store's timeout as ``init_process_group`` set it (the bound a collective
    would have), not the guard's short one: a rank may fall a step behind (saving a checkpoint
    while the others run ahead on queued collectives), and the read waits for it."""
    global _connection
    guard = channel.connection()
    if guard is None:
        return None
    if _connection is None or _connection[0] is not guard:
        from torch.distributed import distributed_c10d as c10d

        own = guard
        try:
            own = guard.clone()
            own.set_timeout(c10d._get_default_store().timeout)
        except (AttributeError, RuntimeError, NotImplementedError):
            pass  # a store without clone(): share the guard's
        _connection = (guard, own)
    return _connection[1]
