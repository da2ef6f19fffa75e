"""The buffers a collective leaves behind, and whether the implementation still holds them.

An all-gather's output and a reduction's input (an unsharded gradient) are memory the
implementation pays for while it keeps them: the schedule view counts such a buffer while its
collective is in flight and, after its result was read, while a Python object still refers to
it. Whether one does is read from reference counts (``held_by_python``), which is exact only
while no C++ holder lets go in between: a backend's worker thread (gloo's) drops a collective's
tensors a moment after the wait returned and then needs the GIL to drop their Python objects,
so for a while a buffer nobody holds looks held (on a loaded machine, for milliseconds).
``CollectiveBuffers`` therefore keeps each collective's work object, which holds its tensors,
for as long as it watches them: the worker is then never the last holder, and the buffers are
let go on the recording thread, when the recorder drops the work.
"""

from __future__ import annotations

import sys
import weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from twinshard.dispatch.storages import memory_key

from .steps import Collective


def storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    """(key, bytes) of a plain tensor's memory (``storages.memory_key``: its address, or a
    ``FakeTensor``'s storage object), None for subclasses or freed memory."""
    if is_traceable_wrapper_subclass(t) or t.device.type == "meta":
        return None
    s = t.untyped_storage()
    if not s.nbytes():
        return None
    return (memory_key(t, s), s.nbytes())


def held_by_python(ref: weakref.ref) -> bool:
    """Whether a Python object refers to the tensor behind ``ref`` (False once it is gone).

    While C++ refers to a tensor (its use count above one) torch keeps the tensor's Python
    object alive for it, with one reference of its own; ``t`` below and ``getrefcount``'s
    argument are two more, and anything beyond is Python's."""
    t = ref()
    if t is None:
        return False
    from_cpp = 1 if t._use_count() > 1 else 0
    return sys.getrefcount(t) - 2 - from_cpp > 0


def is_work(value) -> bool:
    """A collective's work object, as a c10d operator returns it (boxed or not)."""
    return isinstance(value, (dist.Work, torch.ScriptObject))


class CollectiveBuffers:
    """The all-gather outputs and reduction inputs of one recorded step, while they live."""

    def __init__(self):
        self.gathered = []  # (weak reference, Collective): all-gather outputs
        self.reduced = []  # (weak reference, Collective): the gradients being reduced
        self.watched = {}  # collective index -> how many of its buffers are still watched
        self.works = {}  # collective index -> its work objects, kept while any is watched

    def watch(self, c: Collective, gathered=(), reduced=()) -> None:
        """Watch ``c``'s output (an all-gather) or input (a reduction) tensors."""
        self.gathered += [(weakref.ref(t), c) for t in gathered]
        self.reduced += [(weakref.ref(t), c) for t in reduced]
        self.watched[c.index] = len(gathered) + len(reduced)

    def keep_work(self, c: Collective, returned) -> None:
        """Hold the work objects in what ``c``'s operator ``returned`` while it is watched."""
        items = returned if isinstance(returned, (tuple, list)) else [returned]
        works = [w for w in items if is_work(w)]
        if works and self.watched.get(c.index):
            self.works[c.index] = works

    def held(self) -> tuple[set, set]:
        """The storage keys of the all-gather outputs and of the reduction inputs that count
        now: in flight, or read and still referred to from Python. The others are not
        watched any more, and a collective none of whose buffers is watched loses its work."""
        return self._sweep(self.gathered), self._sweep(self.reduced)

    def release(self) -> None:
        """The recording ended: hold no work object any more."""
        self.works.clear()

    def _sweep(self, buffers: list) -> set:
        found, kept = set(), []
        for r, c in buffers:
            if (c.used_tick is not None and not held_by_python(r)) or (t := r()) is None:
                self.watched[c.index] -= 1
                if not self.watched[c.index]:
                    self.works.pop(c.index, None)
                continue
            found.add(storage_key(t) or (0, 0))
            kept.append((r, c))
            del t  # a reference of this loop would count as Python's in the next check
        buffers[:] = kept
        return found
