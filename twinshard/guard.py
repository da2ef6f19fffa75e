"""The collective guard: ranks that disagree are named within seconds, instead of a hang or an
abort inside the backend.

FSDP works only while every rank issues the same collectives in the same order. When they do
not (a model built differently on two ranks, a parameter used on one rank only, one rank
running one more step), gloo aborts ("Received data size doesn't match") or waits until its
timeout. The guard, shared by ``twinshard.reference`` and ``twinshard.optimized``, checks first:

- **Model fingerprint** (always on). At the root's lazy init (its first forward)
  ``check_model`` describes the model in lines (``fingerprint``): every parameter by full name
  with its shape, dtype, ``requires_grad`` and the group that shards it, and every group with
  its implementation, mesh and policies. The ranks compare a hash of the lines; only when the
  hashes differ do they exchange the lines, and every rank raises ``GuardError`` naming the
  first line that differs and the ranks on each side. Any module can be checked, one sharded
  by torch's ``fully_shard`` too (from its parameters alone): call ``check_model(model)``.
- **Collective checks** (debug mode: ``TWINSHARD_DEBUG=1`` or ``twinshard train --debug``).
  Before each collective, ``check_collective`` publishes what this rank is about to issue (op,
  dtype, element count, the ranks of its process group, the parameters, the step and whether
  it is forward or backward) and compares it with what the other ranks of that group publish
  at the same position of that group's sequence. A difference raises ``GuardError`` on every
  rank of the group, naming the parameters and the step. A rank that does not arrive within
  ``TWINSHARD_GUARD_TIMEOUT`` seconds (default 30) is named, with the last collective it did
  reach: that is how one rank running an extra step shows up.

Why it cannot hang. The guard issues no collective. It talks through the key-value store that
every ``torch.distributed`` job already has (the TCPStore of ``init_process_group``, served
by rank 0), on a connection of its own (a clone of the store, with its own timeout), with calls
that answer at once: ``set``, ``check`` (are these keys there yet?) and ``multi_get`` of keys
known to be there. Waiting for a peer is a loop of ``check`` and short sleeps up to a deadline,
so a peer that never comes costs the deadline and no more, and every single call is bounded by
the connection's timeout even if the store's host stops answering. A rank that finds a
difference waits (a few seconds at most) until its peers have seen it too, so that rank 0 does
not take the store down under them, and leaves its message in the store: a peer waiting in
another group's check stops with it instead of waiting for its own deadline.

Cost. Debug off: one test of a module-level boolean per collective, and one fingerprint
exchange per root (a few store round trips, once). Debug on: per collective a ``set``, a
``check``, a ``multi_get`` and a ``delete_key`` on the store, plus the wait for the slowest
peer, which the collective would have waited for anyway (``benchmarks/guard_cost.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["GuardError", "check_collective", "check_model", "fingerprint", "forward_started"]

ENV = "TWINSHARD_DEBUG"  # "1": check every collective across ranks before it is issued
TIMEOUT_ENV = "TWINSHARD_GUARD_TIMEOUT"  # seconds to wait for a peer in a debug check
DEFAULT_TIMEOUT = 30.0
_ACK_WAIT = 5.0  # how long a rank that found a difference waits for its peers to see it
_ERROR_POLL = 0.25  # how often a waiting rank looks for a peer's message
_PREFIX = "twinshard-guard"
_ERROR_KEY = f"{_PREFIX}/error"


class GuardError(RuntimeError):
    """The ranks disagree about the model or about the next collective."""


_debug = False  # read from the environment at each root's lazy init (``check_model``)
_timeout = DEFAULT_TIMEOUT
_step = 0  # the current root's forward count: collectives are labelled with it
_forwards: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # root state -> forwards
_conn: tuple | None = None  # (default process group, the guard's store connection or None)
_seq: dict[tuple, int] = {}  # ranks of a group -> collectives checked on it so far
_last: dict[tuple, str] = {}  # ranks of a group -> the last collective all of them agreed on
_members_of: dict[int, tuple] = {}  # id(process group) -> (group, its ranks)


def refresh() -> None:
    """Read ``TWINSHARD_DEBUG`` and ``TWINSHARD_GUARD_TIMEOUT`` from the environment."""
    global _debug, _timeout
    _debug = os.environ.get(ENV, "0") not in ("", "0")
    _timeout = float(os.environ.get(TIMEOUT_ENV, "") or DEFAULT_TIMEOUT)


def debug_enabled() -> bool:
    """Whether every collective is checked (as of the last root's lazy init)."""
    return _debug


# --- the side channel -------------------------------------------------------------------------
def _connection():
    """The guard's own connection to the job's store, or None where there is nobody to ask
    (no process group, or one process playing every rank on an in-process store)."""
    global _conn
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed import distributed_c10d as c10d

    world = c10d._get_default_group()
    if _conn is not None and _conn[0] is world:
        return _conn[1]
    _seq.clear(), _last.clear(), _members_of.clear()
    store = base = c10d._get_default_store()
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if dist.get_world_size() == 1 or type(base).__name__ in ("HashStore", "FakeStore"):
        _conn = (world, None)
        return None
    try:  # our own socket: its timeout bounds every call without touching torch's
        store = store.clone()
        store.set_timeout(timedelta(seconds=max(_timeout, _ACK_WAIT)))
    except (AttributeError, RuntimeError, NotImplementedError):
        pass  # a store without clone(): share it
    _conn = (world, store)
    return store


def _members(group) -> tuple:
    """The global ranks of ``group`` (None: every rank)."""
    group = group if group is not None else dist.group.WORLD
    hit = _members_of.get(id(group))
    if hit is None or hit[0] is not group:
        hit = _members_of[id(group)] = (group, tuple(dist.get_process_group_ranks(group)))
    return hit[1]


def _exchange(store, topic: str, members: tuple, value: str, deadline: float, errors=True):
    """Post ``value`` under ``topic`` and collect every other member's: ({rank: value}, []),
    or ({}, the ranks still missing) at ``deadline``. Never blocks beyond the deadline."""
    me = dist.get_rank()
    store.set(f"{topic}/{me}", value)
    others = [r for r in members if r != me]
    keys = [f"{topic}/{r}" for r in others]
    pause, look_for_errors = 1e-4, time.monotonic() + _ERROR_POLL
    while not store.check(keys):
        now = time.monotonic()
        if now >= deadline:
            return {}, [r for r, k in zip(others, keys) if not store.check([k])]
        if errors and now >= look_for_errors:
            if store.check([_ERROR_KEY]):
                raise GuardError(store.get(_ERROR_KEY).decode())
            look_for_errors = now + _ERROR_POLL
        time.sleep(pause)
        pause = min(2 * pause, 0.005)
    return {r: v.decode() for r, v in zip(others, store.multi_get(keys))}, []


def _fail(store, topic: str, members: tuple, message: str) -> None:
    """Raise ``message`` once the peers have seen the difference too (bounded wait)."""
    store.set(_ERROR_KEY, message)
    _exchange(store, f"{topic}/seen", members, "1", time.monotonic() + _ACK_WAIT, errors=False)
    raise GuardError(message)


# --- the model fingerprint --------------------------------------------------------------------------
def fingerprint(module: torch.nn.Module, states=()) -> list[str]:
    """The lines ranks compare: each sharded group (``states``: FSDP states of a twinshard
    root) with its implementation, mesh and policies, then each parameter by full name."""
    names = {id(m): n for n, m in module.named_modules()}
    group_of, lines = {}, []
    for state in states:
        where = "+".join(names.get(id(m), "?") or "(root)" for m in _modules_of(state))
        group = state.group
        lines.append(f"group {where}: {type(state).__module__}, {_policies(state)}")
        for p in group.params if group is not None else ():
            group_of[id(p.sharded_param)] = where
    for name, p in module.named_parameters(remove_duplicate=False):
        where = group_of.get(id(p))
        if where is None:
            where = str(tuple(p.placements)) if hasattr(p, "placements") else "not sharded"
        dtype = str(p.dtype).removeprefix("torch.")
        grad = "trainable" if p.requires_grad else "frozen"
        lines.append(f"param {name}: {tuple(p.shape)} {dtype} {grad}, group {where}")
    return lines


def _modules_of(state) -> list:
    return list(getattr(state, "modules", None) or [state.module])


def _policies(state) -> str:
    group, mp = state.group, state.mp
    dtypes = [mp.param_dtype, mp.reduce_dtype, mp.output_dtype]
    text = "mp " + "/".join(str(d).removeprefix("torch.") for d in dtypes)
    text += f" cast_inputs={mp.cast_forward_inputs}"
    if group is None:
        return text + ", no parameters of its own"
    after = group.post_forward_info
    keep = "keep" if after is None else "reshard" if after is group.info else after.shard_size
    shards = sorted({p.shard_device.type for p in group.params})
    return f"{text}, mesh {tuple(group.info.mesh.shape)}, after forward {keep}, shards on {shards}"


def _model_members(module: torch.nn.Module, states) -> tuple:
    meshes = [s.group.info.mesh for s in states if s.group is not None]
    meshes += [p.device_mesh for p in module.parameters() if hasattr(p, "device_mesh")][:1]
    if not meshes:
        return tuple(range(dist.get_world_size()))
    return tuple(sorted({r for mesh in meshes for r in mesh.mesh.flatten().tolist()}))


def check_model(module: torch.nn.Module, states=()) -> None:
    """Compare ``module``'s ``fingerprint`` across the ranks that shard it; raise
    ``GuardError`` on every rank, naming the first difference and the ranks on each side.

    Called at a twinshard root's lazy init (with its states); call it on a model sharded by
    torch's ``fully_shard`` before its first forward. Reads the debug settings too."""
    refresh()
    store = _connection()
    if store is None:
        return
    members = _model_members(module, states)
    if len(members) < 2 or dist.get_rank() not in members:
        return
    lines = fingerprint(module, states)
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    seq = _seq.get(("model", members), 0)
    _seq[("model", members)] = seq + 1
    topic = f"{_PREFIX}/model/{','.join(map(str, members))}/{seq}"
    # Without debug mode a late rank gets as long as a collective would give it.
    wait = _timeout if _debug else max(store.timeout.total_seconds(), _timeout)
    hashes, missing = _exchange(store, topic, members, digest, time.monotonic() + wait)
    label = type(module).__name__
    if missing:
        raise GuardError(
            f"twinshard guard: rank(s) {missing} did not reach the first forward of the model "
            f"({label}) within {wait:.0f} s, where rank {dist.get_rank()} compares models"
        )
    if all(h == digest for h in hashes.values()):
        return
    got, _ = _exchange(
        store, f"{topic}/lines", members, json.dumps(lines), time.monotonic() + _timeout
    )
    every = {dist.get_rank(): lines, **{r: json.loads(v) for r, v in got.items()}}
    _fail(store, f"{topic}/lines", members, _model_difference(label, every))


def _model_difference(label: str, every: dict) -> str:
    """Name the first line where the ranks' fingerprints part, and who is on each side."""
    sides: dict[tuple, list] = {}
    for rank in sorted(every):
        sides.setdefault(tuple(every[rank]), []).append(rank)
    (first, mine), (second, theirs) = list(sides.items())[:2]
    i = next((k for k, (a, b) in enumerate(zip(first, second)) if a != b), None)
    i = min(len(first), len(second)) if i is None else i
    ours = first[i] if i < len(first) else "(nothing more)"
    other = second[i] if i < len(second) else "(nothing more)"
    return (
        f"twinshard guard: the model ({label}) differs across ranks at its first forward; "
        f"first difference (line {i + 1} of its fingerprint):\n"
        f"  rank(s) {mine}: {ours}\n  rank(s) {theirs}: {other}\n"
        "Every rank must build the same model and shard it the same way (the same "
        "fully_shard calls and policies), or the collectives of FSDP cannot match."
    )


# --- collectives (debug mode) -----------------------------------------------------------------------
def forward_started(state) -> None:
    """A root's forward begins: the collectives from here on belong to its next step."""
    global _step
    if _debug and state.is_root:
        _step = _forwards[state] = _forwards.get(state, -1) + 1


def check_collective(op, tensor: torch.Tensor, group, about=None) -> None:
    """Debug mode: check that every rank of ``group`` is about to issue the same collective;
    raise ``GuardError`` on all of them if not. ``op``: "all_gather", "reduce_scatter",
    "all_reduce" or the function that issues it; ``tensor``: this rank's input;
    ``about``: the parameter's full name, or the parameters (names or ``ShardedParam``)."""
    if _debug:
        _check_collective(op, tensor, group, about)


def _check_collective(op, tensor: torch.Tensor, group, about) -> None:
    store = _connection()
    members = _members(group) if store is not None else ()
    if len(members) < 2:
        return
    op = op if isinstance(op, str) else getattr(op, "__name__", str(op))
    op = next((k for k in ("all_gather", "reduce_scatter", "all_reduce") if k in op), op)
    names = [about] if isinstance(about, str) else [getattr(a, "fqn", a) for a in about or ()]
    in_backward = torch._C._current_graph_task_id() != -1
    entry = [op, str(tensor.dtype).removeprefix("torch."), tensor.numel(), names, _step]
    entry = json.dumps(entry + ["backward" if in_backward else "forward"])
    seq = _seq.get(members, 0)
    _seq[members] = seq + 1
    channel = f"{_PREFIX}/c/{','.join(map(str, members))}"
    topic = f"{channel}/{seq}"
    got, missing = _exchange(store, topic, members, entry, time.monotonic() + _timeout)
    if missing:
        message = _absent(members, seq, missing, entry)
        store.set(_ERROR_KEY, message)
        raise GuardError(message)
    if seq >= 2:  # everyone has read entry seq - 2: they all posted seq - 1 after it
        store.delete_key(f"{channel}/{seq - 2}/{dist.get_rank()}")
    if any(v != entry for v in got.values()):
        every = {dist.get_rank(): json.loads(entry), **{r: json.loads(v) for r, v in got.items()}}
        _fail(store, topic, members, _disagreement(members, seq, every))
    _last[members] = entry


def _show(entry: list) -> str:
    op, dtype, numel, names, step, phase = entry
    shown = ", ".join(f"'{n}'" for n in names[:3]) + (
        f" +{len(names) - 3}" if len(names) > 3 else ""
    )
    return f"{op} of {shown or 'no named parameter'} ({dtype}, {numel} elements) at step {step} ({phase})"


def _disagreement(members: tuple, seq: int, every: dict) -> str:
    ranks = sorted(every)
    lines = [
        f"twinshard guard: ranks {list(members)} disagree on their collective #{seq} "
        f"over this group ({_why(every)}):"
    ]
    lines += [f"  rank {r}: {_show(every[r])}" for r in ranks]
    return "\n".join(lines)


def _why(every: dict) -> str:
    """A first guess at the cause, from how the first two different entries differ."""
    (a_rank, a), *rest = sorted(every.items())
    b_rank, b = next((r, e) for r, e in rest if e != a)
    if a[4] != b[4]:
        return (
            f"rank {a_rank} is at step {a[4]}, rank {b_rank} at step {b[4]}: "
            "the ranks ran different numbers of forward passes"
        )
    if a[0] == b[0] and a[3] == b[3]:
        return "the same parameters with other sizes or dtypes: the models or policies differ"
    mine = ([n for n in a[3] if n not in b[3]] or a[3] or ["nothing named"])[0]
    theirs = ([n for n in b[3] if n not in a[3]] or b[3] or ["nothing named"])[0]
    said = f"rank {a_rank} is in {a[0]} of '{mine}' ({a[5]}) at step {a[4]}, "
    if not theirs or set(b[3]) <= set(a[3]) and a[0] == b[0]:
        said += f"which rank {b_rank} leaves out"
    else:
        said += f"rank {b_rank} in {b[0]} of '{theirs}' ({b[5]})"
    if a[0] == b[0] == "reduce_scatter":
        return said + ": a parameter with a gradient on some ranks only (unused on some?)"
    return said + ": the ranks do not run the same modules (one runs on some ranks only?)"


def _absent(members: tuple, seq: int, missing: list, entry: str) -> str:
    last = _last.get(members)
    before = f"#{seq - 1}: {_show(json.loads(last))}" if last else "none yet"
    return (
        f"twinshard guard: rank(s) {missing} did not reach collective #{seq} of ranks "
        f"{list(members)} within {_timeout:g} s, where rank {dist.get_rank()} waits to issue "
        f"{_show(json.loads(entry))}. The last collective they all reached: {before}. A rank "
        "that ran fewer steps or forwards than the others, or is stuck outside the collectives, "
        f"does this (a slow rank needs a larger {TIMEOUT_ENV}; is {ENV} set on every rank?)"
    )
