"""Stand-in streams: the accelerator schedule run on the CPU, every ordering checked.

CI has no GPU, yet the stream-and-event half of the optimized path is where FSDP bugs hide: a
buffer read before the collective that fills it is waited on, memory handed back while
another stream still uses it. With ``TWINSHARD_STANDIN_STREAMS=1`` the optimized path runs its
accelerator schedule on the CPU with these stand-ins. Collectives are then issued blocking (as
on an accelerator, where the stream orders them), so the data is always there; what is checked
instead is whether the *schedule* would have made it be there on a real device.

Each stand-in stream keeps a vector clock (its own count of work, and how far it has waited
for every other stream). Inside ``with standin_streams().checking():``,
``twinshard.conformance.stream_check.StreamSanitizer`` checks every tensor access and every
``release`` against those clocks and raises ``StreamOrderError`` at the first access a device
could get wrong (``twinshard conform --stand-in-streams`` checks every case this way). Every
``wait_stream``, ``record_event``, ``wait_event`` and ``release`` also goes into ``log``, so
tests can assert the schedule's order by name.
"""

from __future__ import annotations

import contextlib
import itertools
import threading

from twinshard.conformance.stream_check import StreamSanitizer


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
