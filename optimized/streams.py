"""Where the optimized schedule runs its work: the streams of one device type.

The schedule is written once against a small stream interface: make a stream, ask for the
current one, run a block of work on a stream (``with streams.use(s)``), and order streams with
``wait_stream`` / ``record_event`` / ``wait_event``. Three implementations stand behind it:

- an accelerator (CUDA and others): ``torch.cuda``'s streams and events, for real overlap;
- the CPU: ``torch.cpu``'s streams, which exist so device-agnostic code runs and do nothing;
  there gloo runs each collective on its own threads, so its *work handle* says when it is
  done, and the collectives are issued with ``async_op=True``. A block of work "on" a CPU
  stream is a context that does nothing (see ``DeviceStreams.use``);
- stand-in streams (``twinshard/dispatch/standin.py``): the accelerator's schedule, run on the CPU in
  CI, with every ``wait_stream`` / ``record_event`` / ``wait_event`` logged and every tensor
  access checked against the order they establish.

``collectives_follow_streams`` is the one difference the schedule sees. Where it is true, a
collective issued on a stream is ordered by that stream like any kernel, so it is issued
blocking (``async_op=False``) and its completion is an event; where it is false, it is issued
asynchronously and its completion is a work handle. Both are ways to wait on one schedule.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

STANDIN_ENV = "TWINSHARD_STANDIN_STREAMS"  # "1": run the accelerator schedule on the CPU


class DeviceStreams:
    """The streams of ``device``'s type, through ``torch.get_device_module``."""

    def __init__(self, device: torch.device):
        self.device = device
        self.module = torch.get_device_module(device.type)
        self.collectives_follow_streams = device.type != "cpu"
        self.streams_do_nothing = device.type == "cpu"
        self.nothing = contextlib.nullcontext()

    def new_stream(self, name: str, priority: int = 0) -> Any:
        """A new stream on the current device; ``name`` only labels stand-in streams. A lower
        ``priority`` is served first when streams compete (-1: higher than compute's 0)."""
        return self.module.Stream(priority=priority)

    def current(self) -> Any:
        return self.module.current_stream()

    def use(self, stream: Any):
        """Context manager: the work inside it is queued on ``stream``. On the CPU, where
        streams do nothing, one shared context that does nothing: ``torch.cpu.stream`` builds
        a ``StreamContext`` for every block (about 6,500 instructions under valgrind; a group
        enters eight such blocks per step)."""
        if self.streams_do_nothing:
            return self.nothing
        return self.module.stream(stream)

    def release(self, tensors, where: str) -> None:
        """The schedule lets ``tensors`` go. Dropping the last reference is all it takes on a
        device; stand-in streams check here that the release was ordered correctly."""


def streams_for(device: torch.device) -> DeviceStreams:
    """The streams the schedule uses on ``device``: stand-ins on the CPU when the environment
    variable ``TWINSHARD_STANDIN_STREAMS=1`` asks for them, else the device's own."""
    if device.type == "cpu" and os.environ.get(STANDIN_ENV, "0") not in ("", "0"):
        from twinshard.dispatch.standin import standin_streams

        return standin_streams()
    return DeviceStreams(device)
