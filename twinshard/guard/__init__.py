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
  first line that differs and the ranks on each side (``model.py``). Any module can be
  checked, one sharded by torch's ``fully_shard`` too (from its parameters alone): call
  ``check_model(model)`` before its first forward.
- **Collective checks** (debug mode: ``TWINSHARD_DEBUG=1`` or ``twinshard train --debug``).
  Before each collective, ``check_collective`` publishes what this rank is about to issue (op,
  dtype, element count, the ranks of its process group, the parameters, the step and whether
  it is forward or backward) and compares it with what the other ranks of that group publish
  at the same position of that group's sequence. A difference raises ``GuardError`` on every
  rank of the group, naming the parameters and the step. A rank that does not arrive within
  ``TWINSHARD_GUARD_TIMEOUT`` seconds (default 30) is named, with the last collective it did
  reach: that is how one rank running an extra step shows up (``collectives.py``). Around
  torch's ``fully_shard``, ``with watch(model): ...`` checks each collective from the
  dispatcher, with the step but without parameter names. ``set_debug`` switches it in code.

Why it cannot hang (``channel.py``). The guard issues no collective. It talks through the
key-value store every ``torch.distributed`` job already has (the TCPStore of
``init_process_group``), on a connection of its own (a clone of the store, with its own
timeout), with calls that answer at once: ``set``, ``check`` (are these keys there yet?) and
``multi_get`` of keys known to be there. Waiting for a peer is a loop of ``check`` and short
sleeps up to a deadline, so a peer that never comes costs the deadline and no more, and every
single call is bounded by the connection's timeout even if the store's host stops answering.
A rank that finds a difference waits (a few seconds at most) until its peers have seen it too,
so that a rank hosting the store does not take it down under them, and leaves its message in
the store: a peer waiting in another group's check stops with it instead of at its deadline.
Only a rank that is inside a check can report: a rank that finished early (the extra-step case)
waits elsewhere, and is named by the ranks that wait for it.

- **Parameters used on some ranks only** (always on, for twinshard's roots). After each
  backward every rank posts the names of the trainable parameters it had no gradient for, and
  reads the tally at the end of the backward if its gradients depend on it, else at the root's
  next forward or optimizer step, where an undeclared one is named (``usage.py``,
  ``unused_grads.py``): no collective, no device value read.

Cost. Debug off: one test of a module-level boolean per collective, and one fingerprint
exchange per root (a few store round trips, once). Debug on: per collective a ``set``, a
``check``, a ``multi_get`` and a ``delete_key`` on the store, plus the wait for the slowest
peer, which the collective would have waited for anyway (``benchmarks/guard_cost.py``).
"""

from __future__ import annotations

from . import unused_grads
from .channel import ENV, TIMEOUT_ENV, GuardError, refresh, set_debug
from .collectives import check_collective, forward_started, watch
from .model import check_model, fingerprint
from .usage import mesh_ranks, post_unused

__all__ = [
    "ENV",
    "TIMEOUT_ENV",
    "GuardError",
    "check_collective",
    "check_model",
    "debug_enabled",
    "fingerprint",
    "forward_started",
    "mesh_ranks",
    "post_unused",
    "refresh",
    "set_debug",
    "unused_grads",
    "watch",
]


def debug_enabled() -> bool:
    """Whether every collective is checked (as of the last root's lazy init or set_debug)."""
    from . import channel

    return channel.debug
