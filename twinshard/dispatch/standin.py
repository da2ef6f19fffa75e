"""Stand-in streams: the accelerator schedule run on the CPU, every ordering checked.

CI has no GPU, yet the stream-and-event half of the optimized path is where FSDP bugs hide: a
buffer read before the collective that fills it is waited on, memory handed back while
another stream still uses it. With ``TWINSHARD_STANDIN_STREAMS=1`` the optimized path runs its
accelerator schedule on the CPU with these stand-ins. Collectives are then issued blocking (as
on an accelerator, where the stream orders them), so the data is always there; what is checked
instead is whether the *schedule* would have made it be there on a real device.

Each stand-in stream keeps a vector clock (its own count of work, and how far it has waited
for every other stream). Inside ``with standin_streams().checking():``, ``StreamSanitizer``
(below) checks every tensor access and every ``release`` against those clocks and raises
``StreamOrderError`` at the first access a device could get wrong (``twinshard conform
--stand-in-streams`` checks every case this way). Every ``wait_stream``, ``record_event``,
``wait_event`` and ``release`` also goes into ``log``, so tests can assert the schedule's order
by name.

The streams and their sanitizer are one module that both the optimized path and the
conformance suite import (the suite's driver pauses the checks around the plain model with
``paused``), so the optimized path imports nothing from the suite. Any implementation that
schedules its work on these stand-in streams is checked the same way.

The sanitizer. This dispatch mode sees every tensor operation and notes, per storage, the last
write and the reads since, each as (stream, time). An access from stream A to data last written
by stream B at time t is a race unless A's clock has B >= t, and a write must likewise come
after every earlier read. ``release`` is where the schedule says a buffer may be reused: every
access must by then be ordered before the stream that allocated it (the one whose memory pool
would hand it out again), and any later use is reported as a use after release. Each violation
raises ``StreamOrderError`` at the operation that commits it, naming the operation and the
streams.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from twinshard.dispatch import c10d
from twinshard.dispatch.storages import memory_key


class StandInEvent:
    """A point on a stream: the stream's clock when it was recorded."""

    _ids = itertools.count()

    def __init__(self, stream: StandInStream):
        self.stream = stream.name
        self.clock = dict(stream.clock)
        self.id = next(self._ids)

    def query(self) -> bool:
        return True  # the CPU has run everything already

    def synchronize(self) -> None:
        """The host waits for the event: nothing to do, the CPU ran it already."""


class StandInStream:
    """A named queue of work with a vector clock; see the module docstring."""

    def __init__(self, name: str, log: list, priority: int = 0):
        self.name = name
        self.clock = {name: 0}
        self.log = log
        self.priority = priority  # as a device stream's: lower is served first

    def tick(self) -> int:
        self.clock[self.name] += 1
        return self.clock[self.name]

    def merge(self, clock: dict) -> None:
        for name, time in clock.items():
            if name != self.name and time > self.clock.get(name, 0):
                self.clock[name] = time

    def record_event(self) -> StandInEvent:
        self.tick()
        event = StandInEvent(self)
        self.log.append(("record_event", self.name, event.id))
        return event

    def wait_event(self, event: StandInEvent) -> None:
        self.merge(event.clock)
        self.log.append(("wait_event", self.name, event.id))

    def wait_stream(self, stream: StandInStream) -> None:
        self.merge(stream.clock)
        self.log.append(("wait_stream", self.name, stream.name))

    def __repr__(self) -> str:
        return f"StandInStream({self.name!r})"


class StandInStreams:
    """The stream interface of ``streams.DeviceStreams``, made of stand-ins, plus the checks."""

    collectives_follow_streams = True

    def __init__(self):
        self.log: list[tuple] = []
        self.default = StandInStream("default", self.log)
        self._local = threading.local()
        self._names: dict[str, int] = {}
        self.sanitizer = StreamSanitizer(self)

    def new_stream(self, name: str, priority: int = 0) -> StandInStream:
        count = self._names[name] = self._names.get(name, 0) + 1
        return StandInStream(name if count == 1 else f"{name}#{count}", self.log, priority)

    def current(self) -> StandInStream:
        return getattr(self._local, "stream", self.default)

    @contextlib.contextmanager
    def use(self, stream: StandInStream):
        previous = self.current()
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous

    def checking(self) -> StreamSanitizer:
        """Context manager: check every tensor access made inside it."""
        return self.sanitizer

    def release(self, tensors, where: str) -> None:
        """The schedule frees ``tensors``: check it may (see the module docstring)."""
        self.log.append(("release", self.current().name, where))
        for t in tensors:
            self.sanitizer.release(t, where)


_STANDIN: StandInStreams | None = None


def standin_streams() -> StandInStreams:
    """The process's stand-in streams, shared by every root module (one current stream)."""
    global _STANDIN
    if _STANDIN is None:
        _STANDIN = StandInStreams()
    return _STANDIN


def reset_standin_streams() -> None:
    """Forget the process's stand-in streams and their log (a rank of ``twinshard.ranks.worlds``
    between two tasks): the next root module starts new ones."""
    global _STANDIN
    _STANDIN = None


# The stream sanitizer: checks the stand-ins' order (see the module docstring).
class StreamOrderError(RuntimeError):
    """The schedule accessed or released memory without the ordering a device needs."""


@dataclass
class Access:
    stream: object
    time: int
    op: str


@dataclass
class StorageRecord:
    storage: weakref.ref  # the storage this record is about (its address may be reused later)
    allocated_on: object
    last_write: Access | None
    reads: dict = field(default_factory=dict)  # stream name -> latest read since the write
    released: str | None = None  # where the schedule released it


class StreamSanitizer(TorchDispatchMode):
    """Checks every tensor access against the stand-in streams' order."""

    def __init__(self, streams):
        super().__init__()
        self.streams = streams
        self.records: dict[int, StorageRecord] = {}

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reads, writes, view = _accesses(func, args, kwargs)
        if not view:
            for t in writes:
                self._access(t, True, func)
            for t in reads:
                self._access(t, False, func)
        out = func(*args, **kwargs)
        if not view:
            known = {_key(t) for t in reads + writes}
            for t in _tensors(out):
                if _key(t) not in known:  # a fresh tensor, allocated on the current stream
                    self._fresh(t, func)
        return out

    def _record(self, t: torch.Tensor) -> StorageRecord | None:
        key = _key(t)
        if key is None:
            return None
        rec = self.records.get(key)
        storage = _storage(t)
        if rec is None or rec.storage() is not storage:  # new, or an old address reused
            rec = StorageRecord(weakref.ref(storage), self.streams.default, None)
            self.records[key] = rec
        return rec

    def _fresh(self, t: torch.Tensor, func) -> None:
        key = _key(t)
        if key is not None:
            stream = self.streams.current()
            self.records[key] = StorageRecord(
                weakref.ref(_storage(t)), stream, Access(stream, stream.tick(), _name(func))
            )

    def _access(self, t: torch.Tensor, write: bool, func) -> None:
        rec = self._record(t)
        if rec is None:
            return
        stream, op = self.streams.current(), _name(func)
        verb = "writes" if write else "reads"
        if rec.released is not None:
            raise StreamOrderError(
                f"{op} on stream '{stream.name}' {verb} a buffer that was "
                f"already released ({rec.released}): use after release"
            )
        earlier = [rec.last_write] if rec.last_write else []
        if write:
            earlier += rec.reads.values()
        for a in earlier:
            if not _ordered(a, stream):
                raise StreamOrderError(
                    f"{op} on stream '{stream.name}' {verb} memory that {a.op} on stream "
                    f"'{a.stream.name}' used, without waiting for it: wait on an event recorded "
                    "after that use first"
                )
        access = Access(stream, stream.tick(), op)
        if write:
            rec.last_write, rec.reads = access, {}
        else:
            rec.reads[stream.name] = access

    def release(self, t: torch.Tensor, where: str) -> None:
        rec = self._record(t)
        if rec is None:
            return
        uses = ([rec.last_write] if rec.last_write else []) + list(rec.reads.values())
        for a in uses:
            if not _ordered(a, rec.allocated_on):
                raise StreamOrderError(
                    f"{where}: a buffer of stream '{rec.allocated_on.name}' is released while "
                    f"{a.op} on stream '{a.stream.name}' may still use it; make "
                    f"'{rec.allocated_on.name}' wait on an event recorded after that use first"
                )
        rec.released = where


def _ordered(access: Access, stream: object) -> bool:
    """Whether ``access`` happens before whatever ``stream`` does next."""
    return access.stream is stream or stream.clock.get(access.stream.name, 0) >= access.time


_SIGNATURES: dict = {}  # op -> (whether it is a view, [(argument, whether the op writes it)])


def _signature(func) -> tuple[bool, list[tuple[str, bool]]]:
    """What the schema of ``func`` says of its tensors, read once per op (every checked
    operation asks, and parsing alias annotations costs more than the check)."""
    found = _SIGNATURES.get(func)
    if found is None:
        schema = func._schema
        if func.namespace == "c10d":  # no alias annotations: c10d.OPS names what it writes
            name = c10d.name_of(func)
            out = c10d.OPS[name].outputs if name else schema.arguments[0].name  # else: first
            found = (False, [(a.name, a.name == out) for a in schema.arguments])
        else:
            returns = schema.returns
            view = bool(returns) and all(
                r.alias_info is not None and not r.alias_info.is_write for r in returns
            )
            writes = [
                (a.name, a.alias_info is not None and a.alias_info.is_write)
                for a in schema.arguments
            ]
            found = (view, writes)
        _SIGNATURES[func] = found
    return found


def _accesses(func, args, kwargs) -> tuple[list, list, bool]:
    """(tensors read, tensors written, whether the op is a view that touches no data)."""
    view, arguments = _signature(func)
    if view:
        return [], [], True
    positional_only = func.namespace == "c10d"  # c10d's ops are called with positions only
    reads, writes = [], []
    for i, (name, write) in enumerate(arguments):
        if i < len(args):
            value = args[i]
        elif positional_only:
            break
        else:
            value = kwargs.get(name)
        (writes if write else reads).extend(_tensors(value))
    return reads, writes, False


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, DTensor):
        return [value.to_local()]
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _storage(t: torch.Tensor):
    return t.untyped_storage()


def _key(t: torch.Tensor) -> int | None:
    if t.device.type != "cpu":
        return None
    try:
        ptr = memory_key(t)
    except (RuntimeError, NotImplementedError):  # tensors without storage (subclasses)
        return None
    return ptr or None


def _name(func) -> str:
    return f"{func.namespace}.{func.__name__}"


_ACTIVE: list[StreamSanitizer] = []  # entered and not yet left


@contextlib.contextmanager
def paused():
    """Run the code inside without checks (the plain model and the oracles use no streams,
    and each checked operation costs tens of microseconds). A no-op when nothing checks, or
    when another dispatch mode sits above the sanitizer."""
    top = _ACTIVE[-1] if _ACTIVE else None
    if top is None or _get_current_dispatch_mode() is not top:
        yield
        return
    top.__exit__(None, None, None)
    try:
        yield
    finally:
        top.__enter__()
