"""Memory by category and collectives, observed from outside the implementation.

``Probe(model, optimizer)`` is a ``TorchDispatchMode``. While it is active (one training
step), it looks after every operator at what is alive and sorts the bytes into categories:

    sharded      the local tensors of the ``DTensor`` parameters (this rank's shards)
    sharded_grad their ``DTensor`` gradients
    optimizer    the optimizer's state tensors
    unsharded    plain-tensor parameters of sharded modules (the all-gathered weights)
    grad         plain-tensor gradients of those (unsharded, not yet reduced)
    comm         tensors handed to a collective (all-gather and reduce-scatter buffers)
    params       parameters of a model without FSDP (plain, DDP), and their .grad in grad

Every tensor it has once seen in a category is remembered through a weak reference and
counted for as long as the implementation keeps it alive (an unsharded gradient that the
implementation took off the parameter and holds until its reduction, a prefetched buffer),
by its storage: a storage shared by several tensors counts once, in the first category above
that claims it, and a storage freed with ``resize_(0)`` counts nothing. Sampling after every
operator sees each allocation right after it happens, which is where peaks are.

The same mode counts the collectives (op, bytes) of ``twinshard.c10d``'s table, as the suite's
trace does: every c10d operator reaches it. A Python process group (``simnet``) bypasses the
dispatcher; it hands its tensors to ``Probe.saw_collective`` itself.

It also samples the C allocator's bytes in use (glibc ``mallinfo2``), which covers the
activations and every temporary: on the CPU the closest thing to an accelerator's
allocator statistics.
"""

from __future__ import annotations

import ctypes
import weakref

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from twinshard import c10d
from twinshard.storages import memory_key

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


class Probe(TorchDispatchMode):
    """Tracks bytes by category (see the module docstring) while active."""

    def __init__(self, model: nn.Module, optimizer=None, sharded_modules=None):
        super().__init__()
        self.modules = list(sharded_modules or [])
        self.plain = not self.modules
        self.optimizer = optimizer
        self.seen: dict[str, dict[int, weakref.ref]] = {c: {} for c in CATEGORIES}
        self.model = model
        self.peak: dict[str, int] = {}  # the categories at the peak of sum(TRACKED)+persistent
        self.peak_total = 0
        self.heap_base = heap_in_use()
        self.heap_peak = 0
        self.collectives: list[tuple[str, int]] = []  # (op, bytes of the larger side)
        self.samples = 0

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
        self.samples += 1
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

    # --- collectives --------------------------------------------------------------------------
    def saw_collective(
        self, op: str, tensors: list[torch.Tensor], nbytes: int | None = None
    ) -> None:
        """Count collective ``op`` on ``tensors`` and the ``nbytes`` it moves (default: those of
        its largest tensor)."""
        if nbytes is None:
            big = max(tensors, key=lambda t: t.numel())
            nbytes = big.numel() * big.element_size()
        self.collectives.append((op, nbytes))
        for t in tensors:
            self._remember("comm", t)
        self.sample()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (call := c10d.call(func, args, kwargs)) is not None:
            self.saw_collective(call.op, call.tensors, call.nbytes)
        else:
            self.sample()
        return out


def sharded_modules(model: nn.Module) -> list[nn.Module]:
    """Every module that holds a parameter of a sharded group: those whose parameters may be
    DTensors (twinshard's or torch's fully_shard), found by the DTensors they hold now."""
    return [
        m
        for m in model.modules()
        if any(isinstance(p, DTensor) for p in m._parameters.values() if p is not None)
    ]
