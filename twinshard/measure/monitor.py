"""What a training step does on the accelerator that a GPU would pay for: one dispatch mode.

``Monitor(accelerator)`` records, per ``Phase`` (``begin`` starts one: setup, step 1, ...),
the host syncs (``Sync``, each with a short stack), the explicit syncs that ``fakecuda``
counted meanwhile, the collectives (``Collective``, as ``twinshard.dispatch.c10d.call`` reads them)
and those given a host tensor, and the peak bytes per device type. It is entered inside
``FakeTensorMode``, so it sees every operator before the fake mode answers it, and can answer
what the fake mode cannot: ``.item()`` (a placeholder) and pinning, which the fake mode does
not implement (``aten._pin_memory`` becomes a copy whose storage is remembered as pinned, and
``is_pinned`` is answered from that). The fake process group cannot refuse a fake host tensor,
so ``_collective`` does.

Memory: every storage an operator touches is held by a strong reference to the storage
object, so that its identity (``_cdata``) stays unique while it is counted, and is dropped at
the count after nothing else uses it; its bytes are read at each count, after each operator
that made a new storage. On real tensors this holding only delays a storage's release to the
next count. ``probe``, when given, sorts the same bytes into its categories: this mode is the
one observer of a step's memory, on the fake accelerator and on the host (``twinshard bench``'s
memory step: ``Monitor("cpu", probe)``, where nothing waits, so it counts only memory and
collectives). ``saw`` takes a collective no dispatcher shows: a Python process group's
(``simnet``).

What each check counts and its target: docs/fake-accelerator.md, the table of checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from twinshard.dispatch import c10d

from . import fakecuda
from .fakecuda import short_stack

aten = torch.ops.aten


@dataclass(frozen=True)
class Sync:
    kind: str  # "item" | "device-to-host copy" | "host-to-device copy"
    op: str  # the operator, with what made it a sync
    stack: tuple[str, ...]


@dataclass(frozen=True)
class Collective:
    op: str  # all_gather | reduce_scatter | all_reduce | broadcast | all_to_all
    dtype: str
    numel: int
    ranks: tuple[int, ...]
    nbytes: int = 0  # of its largest tensor (the whole buffer of an exchange in place)

    def key(self) -> tuple:
        return (self.op, self.dtype, self.numel, len(self.ranks), self.ranks)


@dataclass
class Phase:
    """What one phase (setup, or one training step) did."""

    name: str
    syncs: list[Sync] = field(default_factory=list)
    explicit_syncs: list[tuple[str, list[str]]] = field(default_factory=list)
    host_collectives: list[tuple[Collective, tuple[str, ...]]] = field(default_factory=list)
    collectives: list[Collective] = field(default_factory=list)
    peak_bytes: int = 0  # on the accelerator
    peak_host_bytes: int = 0
    start_bytes: int = 0
    categories: dict = field(default_factory=dict)  # the probe's, at its peak


class Monitor(TorchDispatchMode):
    """The dispatch mode (the module docstring); ``accelerator``: the device type collectives
    must use."""

    def __init__(self, accelerator: str, probe=None):
        super().__init__()
        self.accelerator = accelerator
        self.on_host = accelerator == "cpu"  # a CPU run: no device, so nothing to wait for
        self.probe = probe
        self.phases: list[Phase] = []
        self.storages: dict[int, tuple] = {}  # key -> (the storage, held; its device type)
        self.pinned: set[int] = set()  # keys of host storages pinned (the module docstring)
        # the device's allocations and frees, in order, for the caching allocator's model
        # (``measure.allocator``); None: not kept. See ``live_bytes``.
        self.alloc_log: list | None = None
        self._sizes: dict[int, int] = {}  # key -> bytes last logged
        self.begin("setup")

    # --- phases ---------------------------------------------------------------------------------
    def begin(self, name: str) -> Phase:
        """Start a phase: what follows is recorded under ``name``."""
        if self.phases:
            self._close()
        live = self.live_bytes()
        phase = Phase(name, start_bytes=live.get(self.accelerator, 0))
        phase.peak_bytes = phase.start_bytes
        phase.peak_host_bytes = live.get("cpu", 0)
        self.phases.append(phase)
        self._explicit_mark = len(fakecuda.SYNCS)
        if self.probe is not None:
            self.probe.peak, self.probe.peak_total = {}, 0
        return phase

    @property
    def phase(self) -> Phase:
        return self.phases[-1]

    def _close(self) -> None:
        self.phase.explicit_syncs = list(fakecuda.SYNCS[self._explicit_mark :])
        if self.probe is not None:
            self.phase.categories = dict(self.probe.peak)

    def finish(self) -> list[Phase]:
        self._close()
        return self.phases

    # --- memory -----------------------------------------------------------------------------------
    def _hold(self, t: torch.Tensor) -> bool:
        """Hold ``t``'s storage; True if it was new."""
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.storages:
            return False
        self.storages[key] = (storage, t.device.type)  # a fake tensor's storage is on meta
        return True

    def live_bytes(self) -> dict[str, int]:
        """Bytes per device type of the storages in use (held by more than this monitor).

        With an ``alloc_log``, also log the device's storages that died ("free"), changed size
        ("free", then "alloc": a ``resize_``, FSDP's way of freeing and regrowing a buffer) or
        appeared ("alloc", with the current stream) since the last look: the caching allocator
        serves the same requests, frees first, as they are seen here, at each new storage."""
        out: dict[str, int] = {}
        gone, changed, log, device = [], [], self.alloc_log, self.accelerator
        for key, (storage, kind) in self.storages.items():
            if torch._C._storage_Use_Count(key) <= 1:
                gone.append(key)
                continue
            n = storage.nbytes()
            out[kind] = out.get(kind, 0) + n
            if log is not None and kind == device and self._sizes.get(key, 0) != n:
                changed.append((key, n))
        for key in gone:
            del self.storages[key]
            self.pinned.discard(key)
            if log is not None and self._sizes.pop(key, 0):
                log.append(("free", key))
        if changed:
            self._log_changed(changed)
        return out

    def _log_changed(self, changed: list) -> None:
        stream = fakecuda.current_stream().name
        for key, _ in changed:
            if self._sizes.pop(key, 0):
                self.alloc_log.append(("free", key))
        for key, n in changed:
            if n:
                self._sizes[key] = n
                self.alloc_log.append(("alloc", key, n, stream))

    def _count(self) -> None:
        live = self.live_bytes()
        now = live.get(self.accelerator, 0)
        fakecuda.MEMORY["allocated"] = now
        fakecuda.MEMORY["peak"] = max(fakecuda.MEMORY["peak"], now)
        self.phase.peak_bytes = max(self.phase.peak_bytes, now)
        self.phase.peak_host_bytes = max(self.phase.peak_host_bytes, live.get("cpu", 0))

    # --- dispatch ---------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.phase.name == "setup" and _host_only(args, kwargs):
            with unset_fake_temporarily():  # see [Note: meshes are built on the host]
                return func(*args, **kwargs)
        fake = any(isinstance(t, FakeTensor) for t in tree_leaves(args))
        if func is aten._local_scalar_dense.default:
            if args[0].device.type == self.accelerator and not self.on_host:
                self._sync("item", "aten._local_scalar_dense")
            if fake:  # no value to read: a placeholder, so that the step goes on
                dtype = args[0].dtype
                floating = dtype.is_floating_point or dtype.is_complex  # a float either way
                return False if dtype == torch.bool else 0.0 if floating else 0
        elif fake and func is aten._pin_memory.default:
            out = args[0].clone()
            self._remember_pinned(out)
            return out
        elif fake and func is aten.is_pinned.default:
            return self._is_pinned(args[0])
        pin = kwargs.get("pin_memory") is True
        if pin and self.fake_mode_active():
            kwargs = {**kwargs, "pin_memory": False}
        else:
            pin = False
        if (call := c10d.call(func, args, kwargs)) is not None:
            self._collective(call)
        elif self.on_host:
            pass
        elif func is aten._to_copy.default:
            pin = self._copy(args[0], kwargs.get("device") or args[0].device, kwargs, pin)
        elif func is aten.copy_.default:
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            self._copy(args[1], args[0].device, {"non_blocking": non_blocking}, None, args[0])
        out = func(*args, **kwargs)
        new = False
        for t in _storage_holders(tree_leaves((args, out))):
            new = self._hold(t) or new
        if pin:
            self._remember_pinned(out)
        if new:
            self._count()
        if self.probe is not None:
            self.probe.sample()
        return out

    def _collective(self, call: c10d.Call) -> None:
        entry = Collective(call.op, call.dtype, call.numel, tuple(call.ranks()), call.nbytes)
        self.phase.collectives.append(entry)
        if not self.on_host and any(t.device.type != self.accelerator for t in call.tensors):
            self.phase.host_collectives.append((entry, tuple(short_stack())))
        if self.probe is not None:
            self.probe.saw_collective(call.tensors)

    def saw(self, op: str, tensors: list[torch.Tensor]) -> None:
        """Collective ``op`` on ``tensors``, issued where no dispatcher shows it."""
        big = max(tensors, key=lambda t: t.numel())
        self._collective(c10d.Call(op, op, big.numel(), big, tensors, tensors, None, False))

    def _copy(self, src: torch.Tensor, to, kwargs, pin, dst=None) -> bool:
        """Note a copy of ``src`` to device ``to`` (into ``dst`` for ``copy_``) if the host
        waits for it; return whether a ``_to_copy``'s output is pinned: torch pins the output
        of a ``non_blocking`` copy from an accelerator to the host itself, so that it can be."""
        to, what = torch.device(to), "aten._to_copy" if dst is None else "aten.copy_"
        blocking = not kwargs.get("non_blocking")
        if src.device.type == self.accelerator and to.type == "cpu":
            pinned = (pin or not blocking) if dst is None else self._is_pinned(dst)
            if blocking or not pinned:
                why = "blocking" if blocking else "non_blocking into pageable memory"
                self._sync("device-to-host copy", f"{what} ({why})")
            return pinned
        if src.device.type == "cpu" and to.type == self.accelerator and blocking:
            self._sync("host-to-device copy", f"{what} (blocking)")
        return bool(pin)

    def _sync(self, kind: str, op: str) -> None:
        self.phase.syncs.append(Sync(kind, op, tuple(short_stack())))

    # --- pinned memory ----------------------------------------------------------------------------
    def _remember_pinned(self, t) -> None:
        if isinstance(t, torch.Tensor):
            self._hold(t)
            self.pinned.add(t.untyped_storage()._cdata)

    def _is_pinned(self, t: torch.Tensor) -> bool:
        if isinstance(t, FakeTensor):
            return t.untyped_storage()._cdata in self.pinned
        return t.is_pinned()

    @staticmethod
    def fake_mode_active() -> bool:
        from torch._guards import detect_fake_mode

        return detect_fake_mode() is not None


def _host_only(args, kwargs) -> bool:
    """Whether an operator works on real host tensors alone: at least one, all of them real
    (not fake) and on the CPU, and no device argument naming another device.

    [Note: meshes are built on the host]
    ``fully_shard`` runs inside ``FakeTensorMode`` (torch's makes device tensors when it
    shards), and a ``reshard_after_forward`` of N builds a ``DeviceMesh`` of rows of N ranks
    from the mesh's rank tensor, then reads the ranks of this rank's row back. Inside the fake
    mode that arithmetic would make fake tensors, whose ranks cannot be read. So during setup
    an operator on real host tensors alone runs for real: it is bookkeeping of the host, not
    work of the device. Meta tensors (the model before ``to_empty``) stay with the fake mode."""
    device = kwargs.get("device")
    if device is not None and torch.device(device).type != "cpu":
        return False
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return bool(tensors) and all(
        t.device.type == "cpu" and not isinstance(t, FakeTensor) for t in tensors
    )


def _storage_holders(values):
    """The tensors with storage of their own among ``values``: a wrapper subclass such as
    ``DTensor`` is replaced by the tensors it wraps (their operators need not pass this mode)."""
    for t in values:
        if not isinstance(t, torch.Tensor) or t.is_sparse:
            continue
        if is_traceable_wrapper_subclass(t):
            inner, _ = t.__tensor_flatten__()
            yield from _storage_holders(getattr(t, name) for name in inner)
        else:
            yield t
