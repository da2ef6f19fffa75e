"""Memory by category and collectives, observed from outside the implementation.

``Probe(model, optimizer)`` is what ``monitor.Monitor``, the one dispatch mode that watches a
step, asks after every operator: ``sample`` remembers the tensors visible now (parameters,
gradients, optimizer state; ``_look``) under the category each is in and adds up the bytes of those
still alive, keeping the categories at the largest sum as ``peak``. Tensors are held by weak
references keyed by ``id``, so the probe never keeps anything alive; an ``id`` reused after its
tensor died is remembered anew. Bytes are counted per storage (``storages.memory_key``), once, in
the first category of ``CATEGORIES`` that claims it; ``roles`` gives the same first-claim answer per
storage for callers that sort storages themselves; ``saw_collective`` counts a collective's buffers
as ``comm``. ``heap_in_use`` reads glibc's ``mallinfo2`` (0 where the C library has none).
``sharded_modules`` finds the modules that hold ``DTensor`` parameters, which is all the probe needs
to know of an implementation.

The categories and how to read them: docs/benchmarks.md, "Memory by category, observed from
outside".
"""

from __future__ import annotations

import ctypes
import weakref

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from twinshard.dispatch.storages import memory_key

CATEGORIES = ("sharded", "sharded_grad", "optimizer", "params", "unsharded", "grad", "comm")
TRACKED = ("unsharded", "grad", "comm")  # what FSDP adds on top of the persistent state


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
        ).split()
    ]


def _libc_mallinfo2():
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):  # not glibc (or glibc < 2.33)
        return None
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _libc_mallinfo2()


def heap_in_use() -> int:
    """Bytes the C allocator has handed out and not taken back (0 where unknown)."""
    if _MALLINFO2 is None:
        return 0
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class Probe:
    """Tracks bytes by category, sample by sample (the categories: docs/benchmarks.md)."""

    def __init__(self, model: nn.Module, optimizer=None, sharded_modules=None):
        self.modules = list(sharded_modules or [])
        self.plain = not self.modules
        self.optimizer = optimizer
        self.seen: dict[str, dict[int, weakref.ref]] = {c: {} for c in CATEGORIES}
        self.model = model
        self.peak: dict[str, int] = {}  # the categories at the peak of sum(TRACKED)+persistent
        self.peak_total = 0
        self.heap_base = heap_in_use()
        self.heap_peak = 0

    # --- what is alive ----------------------------------------------------------------------
    def _remember(self, category: str, t: torch.Tensor | None) -> None:
        if t is not None:
            refs = self.seen[category]
            old = refs.get(id(t))
            if old is None or old() is not t:  # new, or an id reused after the old one died
                refs[id(t)] = weakref.ref(t)

    def _look(self) -> None:
        """Remember the tensors that are visible now: parameters, gradients, optimizer state."""
        if self.plain:
            for p in self.model.parameters():
                self._remember("params", p)
                self._remember("grad", p.grad)
        for module in self.modules:
            for p in module._parameters.values():
                if p is None:
                    continue
                if isinstance(p, DTensor):
                    self._remember("sharded", p._local_tensor)
                    if p.grad is not None:
                        self._remember("sharded_grad", _local(p.grad))
                else:
                    self._remember("unsharded", p)
                    self._remember("grad", p.grad)
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        self._remember("optimizer", _local(v))

    def sample(self) -> dict[str, int]:
        """Bytes alive now, by category; updates the peak."""
        self._look()
        counted: set[int] = set()
        now = dict.fromkeys(CATEGORIES, 0)
        for category in CATEGORIES:
            refs = self.seen[category]
            for key in [k for k, r in refs.items() if r() is None]:
                del refs[key]
            for t in [r() for r in refs.values()]:
                if t is None:
                    continue
                storage = t.untyped_storage()
                ptr = memory_key(t, storage)
                if ptr and ptr not in counted:
                    counted.add(ptr)
                    now[category] += storage.nbytes()
        total = sum(now.values())
        if total > self.peak_total:
            self.peak_total, self.peak = total, now
        self.heap_peak = max(self.heap_peak, heap_in_use() - self.heap_base)
        return now

    def roles(self, shards=()) -> dict[int, str]:
        """Every storage (by its object, ``_cdata``) that a category claims now -> the first
        category above that claims it; ``shards``: weak references to shards seen earlier."""
        self._look()
        for ref in shards:
            if (t := ref()) is not None:
                self.seen["sharded"][id(t)] = ref
        roles: dict[int, str] = {}
        for category in reversed(CATEGORIES):  # the first claim wins: written last
            for t in [r() for r in self.seen[category].values()]:
                if t is not None:
                    roles[t.untyped_storage()._cdata] = category
        return roles

    def saw_collective(self, tensors: list[torch.Tensor]) -> None:
        """A collective on ``tensors``: they count as ``comm`` while they live."""
        for t in tensors:
            self._remember("comm", t)
        self.sample()


def sharded_modules(model: nn.Module) -> list[nn.Module]:
    """Every module that holds a parameter of a sharded group: those whose parameters may be
    DTensors (twinshard's or torch's fully_shard), found by the DTensors they hold now."""
    return [
        m
        for m in model.modules()
        if any(isinstance(p, DTensor) for p in m._parameters.values() if p is not None)
    ]
