"""The fake accelerator's device module: what ``torch.cuda`` answers, answered on the CPU.

Code written for an accelerator asks its device module for streams, events, the current
device, the RNG and memory figures, always through ``torch.get_device_module(device.type)``
(the optimized path's ``streams.DeviceStreams``, torch's FSDP2 ``_get_device_handle``, the
optimizers). ``fakedevice.register`` registers *this module* as the fake device's module, so
those questions reach the functions below, with ``torch.cuda``'s names and signatures.

Streams and events are the project's stand-ins (``twinshard.dispatch.standin``): each
stream keeps a vector clock and every ``wait_stream``, ``record_event`` and ``wait_event``
goes into ``LOG`` with the same tuples the stand-in streams log, so the order a schedule
establishes on this device can be compared by name with the stand-in run on the CPU and with
the real streams on a GPU (``benchmarks/stream_order.py``). A stream is named by the order in
which it was made (``stream1``, ``stream2``, ...); the current stream is ``default`` until a
``stream(s)`` block or ``set_stream`` changes it.

Every explicit synchronization (``synchronize()`` of the module, of a stream or of an event)
is counted in ``SYNCS`` with where it came from: it is a host sync the caller asked for, which
the fake-accelerator run reports apart from the hidden ones (``.item()``, blocking copies).
Nothing here computes: the CPU ran everything already, so every query answers "done".
"""

from __future__ import annotations

import contextlib
import itertools
import traceback

import torch

from twinshard.dispatch.standin import StandInStream

DEVICE_TYPE = "fakecuda"  # the device this module answers for: a stand-in for cuda
DEVICES_PER_HOST = 8  # what device_count() answers: one host of eight, as a GPU node has

LOG: list[tuple] = []  # ("wait_stream" | "record_event" | "wait_event", stream, other)
SYNCS: list[tuple[str, list[str]]] = []  # (what was synchronized, a short stack) per call
_names = itertools.count(1)
_event_ids = itertools.count()


_NOT_MINE = (
    "/twinshard/measure/fakecuda.py",
    "/twinshard/measure/monitor.py",
    "/torch/_",
    "/torch/utils/_",
    "/torch/overrides.py",
    "<frozen",
)


def short_stack(depth: int = 5) -> list[str]:
    """The last ``depth`` frames of the code that made the call, as "dir/file:line in
    function" (torch's dispatch machinery and this package left out)."""
    frames = [f for f in traceback.extract_stack() if not any(s in f.filename for s in _NOT_MINE)]
    return [
        f"{'/'.join(f.filename.rsplit('/', 2)[-2:])}:{f.lineno} in {f.name}"
        for f in frames[-depth:]
    ]


def _explicit_sync(what: str) -> None:
    SYNCS.append((what, short_stack()))


class Stream(StandInStream):
    """``torch.cuda.Stream`` made of a stand-in: ordering is logged, nothing runs."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        super().__init__(kwargs.pop("name", None) or f"stream{next(_names)}", LOG)
        self.priority = priority  # FSDP2 gives its side streams -1 (higher); kept to be asked

    @property
    def device(self) -> torch.device:
        return torch.device(DEVICE_TYPE, 0)

    def record_event(self, event: Event | None = None) -> Event:
        event = event if event is not None else Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _explicit_sync(f"{self.name}.synchronize()")


class Event:
    """``torch.cuda.Event``: a stream's clock at the moment it was recorded."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, **kwargs):
        self.id = next(_event_ids)
        self.stream: str | None = None
        self.clock: dict = {}

    def record(self, stream: Stream | None = None) -> None:
        stream = stream if stream is not None else current_stream()
        stream.tick()
        self.stream, self.clock = stream.name, dict(stream.clock)
        LOG.append(("record_event", stream.name, self.id))

    def wait(self, stream: Stream | None = None) -> None:
        (stream if stream is not None else current_stream()).wait_event(self)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _explicit_sync(f"event recorded on {self.stream}.synchronize()")

    def elapsed_time(self, end: Event) -> float:
        return 0.0  # no time passes on a device that does not compute


_DEFAULT = Stream(name="default")
_current = _DEFAULT
# One current stream for the process, not one per thread: autograd runs backward on a
# thread of its own for a non-CPU device, and on a real device the engine gives that thread
# the stream the forward ran on; the main thread waits meanwhile, so one global says the same.


def current_stream(device=None) -> Stream:
    return _current


def default_stream(device=None) -> Stream:
    return _DEFAULT


def set_stream(stream: Stream) -> None:
    global _current
    if stream is not None:
        _current = stream


@contextlib.contextmanager
def stream(s: Stream | None):
    """Context manager: the work inside it is queued on ``s`` (``None``: unchanged)."""
    previous = _current
    set_stream(s)
    try:
        yield
    finally:
        set_stream(previous)


StreamContext = stream


def synchronize(device=None) -> None:
    _explicit_sync("synchronize()")


# --- the device ---------------------------------------------------------------------------------
def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True  # the device is chosen at registration: DeviceMesh need not guess one


def _lazy_init() -> None:
    """Nothing to initialize."""


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return DEVICES_PER_HOST


def current_device() -> int:
    return 0  # each process plays one rank on its device 0, as with one visible GPU per rank


def set_device(device) -> None:
    """Every rank is played on device 0 (see ``current_device``)."""


@contextlib.contextmanager
def device(index):
    yield


def get_device_name(device=None) -> str:
    return "fake accelerator (twinshard.measure.fakeaccel)"


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def get_amp_supported_dtype() -> list[torch.dtype]:
    """What autocast may compute in here: asked by ``torch.amp.autocast``, which activation
    checkpointing enters around its recompute (without it that recompute fails, in backward)."""
    return [torch.float16, torch.bfloat16]


def empty_cache() -> None:
    """No cache: the fake allocations hold no memory."""


# --- the RNG: a state of its own, kept for callers that save and restore it -----------------
_rng_state = torch.zeros(16, dtype=torch.uint8)
_seed = 0


def get_rng_state(device=None) -> torch.Tensor:
    return _rng_state.clone()


def set_rng_state(state: torch.Tensor, device=None) -> None:
    global _rng_state
    _rng_state = state.clone()


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state()]


def set_rng_state_all(states) -> None:
    set_rng_state(states[0])


def manual_seed(seed: int) -> None:
    global _seed
    _seed = int(seed)


manual_seed_all = manual_seed


def seed() -> None:
    """Keep the seed: fake tensors hold no values for it to change."""


seed_all = seed


def initial_seed() -> int:
    return _seed


# --- memory: the bytes the running monitor counts (0 when none runs) ----------------------------
MEMORY = {"allocated": 0, "peak": 0}


def memory_allocated(device=None) -> int:
    return MEMORY["allocated"]


def max_memory_allocated(device=None) -> int:
    return MEMORY["peak"]


def reset_peak_memory_stats(device=None) -> None:
    MEMORY["peak"] = MEMORY["allocated"]
