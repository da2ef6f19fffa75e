"""The guard's side channel: the job's key-value store, reached on a connection of its own.

Every rank posts a value under a key of its own (``topic/rank``) and reads the others' once
they are all there. Nothing here is a collective and nothing blocks: ``set``, ``check`` and
``multi_get`` answer at once, waiting is ``check`` and a short sleep in a loop up to a
deadline, and the connection's own timeout bounds every call even if the store's host stops
answering. See the package docstring for why that keeps the guard from ever hanging.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch.distributed as dist

from twinshard.dispatch.c10d import exchanges_values

ENV = "TWINSHARD_DEBUG"  # "1": check every collective across ranks before it is issued
TIMEOUT_ENV = "TWINSHARD_GUARD_TIMEOUT"  # seconds to wait for a peer in a debug check
DEFAULT_TIMEOUT = 30.0
ACK_WAIT = 5.0  # how long a rank that found a difference waits for its peers to see it
ERROR_POLL = 0.25  # how often a waiting rank looks for a peer's message
PREFIX = "twinshard-guard"
ERROR_KEY = f"{PREFIX}/error"


class GuardError(RuntimeError):
    """The ranks disagree about the model or about the next collective."""


GuardError.__module__ = "twinshard.guard"  # where it is imported from, and reported as


debug = False  # check every collective; read from the environment at each root's lazy init
timeout = DEFAULT_TIMEOUT  # seconds a debug check waits for its peers
seq: dict[tuple, int] = {}  # ranks of a group (or ("model", ranks)) -> checks on it so far
_conn: tuple | None = None  # (default process group, the guard's store connection or None)
_members_of: dict[int, tuple] = {}  # id(process group) -> (group, its ranks)


def refresh() -> None:
    """Read ``TWINSHARD_DEBUG`` and ``TWINSHARD_GUARD_TIMEOUT`` from the environment."""
    global debug, timeout
    debug = os.environ.get(ENV, "0") not in ("", "0")
    timeout = float(os.environ.get(TIMEOUT_ENV, "") or DEFAULT_TIMEOUT)


def set_debug(on: bool) -> None:
    """Turn the per-collective checks on or off in this process (as ``TWINSHARD_DEBUG``)."""
    global debug
    debug = bool(on)


def connection():
    """The guard's own connection to the job's store, or None where there is nobody to ask
    (no process group, one rank, or one process playing every rank: PyTorch's fake process
    group, or an in-process store)."""
    global _conn
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed import distributed_c10d as c10d

    world = c10d._get_default_group()
    if _conn is not None and _conn[0] is world:
        return _conn[1]
    seq.clear(), _members_of.clear()
    store = base = c10d._get_default_store()
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    # PyTorch's fake process group (one process playing one rank of many) has nobody to ask,
    # whatever its store: a FakeStore comes back from a PrefixStore as a plain Store
    alone = dist.get_world_size() == 1 or not exchanges_values(world)
    if alone or type(base).__name__ in ("HashStore", "FakeStore"):
        _conn = (world, None)
        return None
    try:  # our own socket: its timeout bounds every call without touching torch's
        store = store.clone()
        store.set_timeout(timedelta(seconds=max(timeout, ACK_WAIT)))
    except (AttributeError, RuntimeError, NotImplementedError):
        pass  # a store without clone(): share it
    _conn = (world, store)
    return store


def members(group) -> tuple:
    """The global ranks of ``group`` (None: every rank)."""
    group = group if group is not None else dist.group.WORLD
    hit = _members_of.get(id(group))
    if hit is None or hit[0] is not group:
        hit = _members_of[id(group)] = (
            group,
            tuple(dist.get_process_group_ranks(group)),
        )
    return hit[1]


def exchange(store, topic: str, ranks: tuple, value: str, deadline: float, errors=True):
    """Post ``value`` under ``topic`` and collect every other rank's: ({rank: value}, []), or
    ({}, the ranks still missing) at ``deadline``. Never blocks beyond the deadline; raises a
    peer's ``GuardError`` if one was left in the store meanwhile (``errors``)."""
    me = dist.get_rank()
    store.set(f"{topic}/{me}", value)
    others = [r for r in ranks if r != me]
    keys = [f"{topic}/{r}" for r in others]
    pause, look_for_errors, earlier = 1e-4, 0.0, None
    while not store.check(keys):
        now = time.monotonic()
        if now >= deadline:
            return {}, [r for r, k in zip(others, keys) if not store.check([k])]
        if errors and now >= look_for_errors:
            message = store.get(ERROR_KEY).decode() if store.check([ERROR_KEY]) else None
            if look_for_errors and message != earlier:  # left by a peer while we waited
                raise GuardError(message)
            earlier, look_for_errors = message, now + ERROR_POLL
        time.sleep(pause)
        pause = min(2 * pause, 0.005)
    return {r: v.decode() for r, v in zip(others, store.multi_get(keys))}, []


def fail(store, topic: str, ranks: tuple, message: str) -> None:
    """Leave ``message`` for every rank and raise it once the peers have seen the difference
    too (a bounded wait: rank 0 may host the store, and must not take it down under them)."""
    store.set(ERROR_KEY, message)
    exchange(store, f"{topic}/seen", ranks, "1", time.monotonic() + ACK_WAIT, errors=False)
    raise GuardError(message)


def give_up(store, message: str) -> None:
    """Leave ``message`` for every rank and raise it at once (a peer is missing)."""
    store.set(ERROR_KEY, message)
    raise GuardError(message)
