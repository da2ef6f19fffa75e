"""Debug mode: every collective checked across the ranks of its group before it is issued.

Each rank keeps a sequence number per group (by its ranks) and posts, under that number, what
it is about to issue: op, dtype, element count, the parameters, the step (the root's forward
count) and forward or backward. When the entries differ, every rank of the group raises the
same ``GuardError``, with a first guess at the cause; a rank that does not post in time is
named with the last collective all of them reached. ``watch`` does the same for code that
does not call the guard itself (torch's ``fully_shard``), from the dispatcher, without names.
"""

from __future__ import annotations

import contextlib
import json
import time
import weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from twinshard.dispatch import c10d

from . import channel, unused_grads
from .channel import ENV, PREFIX, TIMEOUT_ENV

CHECKED = ("all_gather", "reduce_scatter", "all_reduce")  # what ``watch`` checks of c10d.OPS
_step = 0  # the current root's forward count: collectives are labelled with it
_forwards: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # root -> its forwards
_last: dict[tuple, str] = {}  # ranks of a group -> the last collective all of them reached


def forward_started(state) -> None:
    """A root's forward begins: the collectives from here on belong to its next step, and its
    last backward, if not settled yet, is now (``unused_grads``)."""
    global _step
    unused_grads.settle(state)
    if channel.debug and getattr(state, "is_root", True):
        _step = _forwards[state] = _forwards.get(state, -1) + 1


def check_collective(op, tensor: torch.Tensor, group, about=None) -> None:
    """Debug mode: check that every rank of ``group`` is about to issue the same collective;
    raise ``GuardError`` on all of them if not. ``op``: "all_gather", "reduce_scatter",
    "all_reduce" or the function that issues it; ``tensor``: this rank's input;
    ``about``: the parameter's full name, or the parameters (names or ``ShardedParam``)."""
    if channel.debug:
        _check(op, tensor, group, about)


def _check(op, tensor: torch.Tensor, group, about) -> None:
    store = channel.connection()
    ranks = channel.members(group) if store is not None else ()
    if len(ranks) < 2:
        return
    op = c10d.kind(op)  # a custom all-gather or reduce-scatter hook by its class
    names = [about] if isinstance(about, str) else [getattr(a, "fqn", a) for a in about or ()]
    in_backward = torch._C._current_graph_task_id() != -1
    entry = [op, str(tensor.dtype).removeprefix("torch."), tensor.numel(), names, _step]
    entry = json.dumps(entry + ["backward" if in_backward else "forward"])
    seq = channel.seq.get(ranks, 0)
    channel.seq[ranks] = seq + 1
    topic = f"{PREFIX}/c/{','.join(map(str, ranks))}/{seq}"
    deadline = time.monotonic() + channel.timeout
    got, missing = channel.exchange(store, topic, ranks, entry, deadline)
    if missing:
        channel.give_up(store, _absent(ranks, seq, missing, entry))
    if seq >= 2:  # everyone has read entry seq - 2: each posted seq - 1 after reading it
        store.delete_key(f"{topic.rsplit('/', 1)[0]}/{seq - 2}/{dist.get_rank()}")
    if any(v != entry for v in got.values()):
        every = {
            dist.get_rank(): json.loads(entry),
            **{r: json.loads(v) for r, v in got.items()},
        }
        channel.fail(store, topic, ranks, _disagreement(ranks, seq, every))
    _last[ranks] = entry


def _show(entry: list) -> str:
    op, dtype, numel, names, step, phase = entry
    shown = ", ".join(f"'{n}'" for n in names[:3]) + (
        f" +{len(names) - 3}" if len(names) > 3 else ""
    )
    of = f" of {shown}" if shown else ""
    return f"{op}{of} ({dtype}, {numel} elements) at step {step} ({phase})"


def _disagreement(ranks: tuple, seq: int, every: dict) -> str:
    lines = [
        f"twinshard guard: ranks {list(ranks)} disagree on their collective #{seq}: {_why(every)}"
    ]
    lines += [f"  rank {r}: {_show(every[r])}" for r in sorted(every)]
    return "\n".join(lines)


def _why(every: dict) -> str:
    """A first guess at the cause, from how the first two different entries differ."""
    (a_rank, a), *rest = sorted(every.items())
    b_rank, b = next((r, e) for r, e in rest if e != a)
    if a[4] != b[4]:
        return (
            f"rank {a_rank} is at step {a[4]}, rank {b_rank} at step {b[4]}; the ranks ran "
            "different numbers of forward passes"
        )
    if a[0] == b[0] and a[3] == b[3] and a[5] == b[5]:
        return "the same collective with other sizes or dtypes; the models or policies differ"
    if a[3] == b[3]:  # no names (or the same) in another op or pass
        said = (
            f"at step {a[4]}, rank {a_rank} is in {a[0]} ({a[5]}), rank {b_rank} in {b[0]} ({b[5]})"
        )
        return said + "; the ranks do not run the same modules (one runs on some ranks only?)"
    mine = ([n for n in a[3] if n not in b[3]] or a[3] or ["-"])[0]
    theirs = ([n for n in b[3] if n not in a[3]] or b[3] or ["-"])[0]
    said = f"at step {a[4]}, rank {a_rank} is in {a[0]} of '{mine}' ({a[5]}), "
    if set(b[3]) < set(a[3]) and a[0] == b[0]:
        said += f"which rank {b_rank} leaves out"
    else:
        said += f"rank {b_rank} in {b[0]} of '{theirs}' ({b[5]})"
    if a[0] == b[0] == "reduce_scatter":
        return said + "; a parameter with a gradient on some ranks only (unused on some?)"
    return said + "; the ranks do not run the same modules (one runs on some ranks only?)"


def _absent(ranks: tuple, seq: int, missing: list, entry: str) -> str:
    last = _last.get(ranks)
    before = f"#{seq - 1}: {_show(json.loads(last))}" if last else "none yet"
    return (
        f"twinshard guard: rank(s) {missing} did not reach collective #{seq} of ranks "
        f"{list(ranks)} within {channel.timeout:g} s, where rank {dist.get_rank()} waits to "
        f"issue {_show(json.loads(entry))}. The last collective they all reached: {before}. "
        "A rank that ran fewer steps or forwards than the others, or is stuck outside the "
        f"collectives, does this (a slow rank needs a larger {TIMEOUT_ENV}; is {ENV} set on "
        "every rank?)"
    )


class _Watch(TorchDispatchMode):
    """Checks each ``c10d`` collective as it reaches the dispatcher."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        call = c10d.call(func, args, kwargs)
        if call is not None and c10d.OPS[call.name].kind in CHECKED and call.group is not None:
            check_collective(call.name, call.big, call.group)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def watch(model: torch.nn.Module | None = None):
    """Check every collective issued inside (debug mode) from the dispatcher, for code that
    does not call the guard: ``with guard.watch(model): ...`` around a loop of torch's
    ``fully_shard``. Steps are ``model``'s forwards; parameters are not named."""
    hook = None if model is None else model.register_forward_pre_hook(_count(model))
    try:
        with _Watch():
            yield
    finally:
        if hook is not None:
            hook.remove()


def _count(model):
    return lambda module, args: forward_started(model)
