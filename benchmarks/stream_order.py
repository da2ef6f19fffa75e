"""The optimized path's order of stream waits and events: the device's against the stand-ins'.

    python benchmarks/stream_order.py                    # the fake accelerator (no GPU needed)
    python benchmarks/stream_order.py --device cuda      # a real GPU's streams (gpu.sh runs it)

The optimized path's accelerator schedule is checked on the CPU with stand-in streams
(``twinshard/dispatch/standin.py``), which log every ``wait_stream``, ``record_event`` and ``wait_event``.
The same schedule runs on the fake accelerator through ``fakecuda`` (the same log) and on a real
GPU through ``torch.cuda``'s streams and events, which ``CudaRecorder`` logs the same way. If
the logs are one sequence, the stand-in checks (the stream sanitizer that CI runs) checked the
order the device gets; the exit status is 1 if they differ.

Streams and events have different names in each run (``copy_in`` on the stand-ins,
``stream1`` on the fakecuda, a pointer on a GPU), so ``canonical`` renames them: streams in the
order they first appear, an event after the recording it refers to. ``orders(config, on)``
records two steps of the optimized path both ways in this process (a tiny Llama, bf16, world
size 8 played by one process on the fake process group; ``on``: "fake" or "cuda") and
``first_difference`` says where they part. ``tests/measuring/test_fake_accelerator.py`` runs
it on the fake accelerator.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from unittest import mock

import torch

from twinshard.measure.job import Job

KINDS = ("wait_stream", "record_event", "wait_event")


def canonical(log: list[tuple]) -> list[tuple[str, str, str]]:
    """``log`` (kind, stream, other) with streams named s0, s1, ... in order of appearance and
    each event named after its recording (e0, e1, ...); entries of other kinds dropped."""
    streams: dict = {}
    events: dict = {}
    recorded = 0
    out = []

    def stream(name) -> str:
        return streams.setdefault(name, f"s{len(streams)}")

    for kind, name, other in (e for e in log if e[0] in KINDS):
        if kind == "wait_stream":
            out.append((kind, stream(name), stream(other)))
        elif kind == "record_event":
            events[other], recorded = f"e{recorded}", recorded + 1
            out.append((kind, stream(name), events[other]))
        else:
            out.append((kind, stream(name), events.get(other, "an event never recorded")))
    return out


def first_difference(a: list[tuple], b: list[tuple]) -> str | None:
    """None if the canonical logs ``a`` and ``b`` are equal, else where they first differ."""
    if a == b:
        return None
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    mine = a[i] if i < len(a) else "nothing"
    theirs = b[i] if i < len(b) else "nothing"
    return f"entry #{i}: {mine} against {theirs} ({len(a)} against {len(b)} entries)"


class CudaRecorder:
    """Logs ``torch.cuda``'s stream and event calls as the stand-ins log theirs, while active.

    ``torch.cuda.Stream.wait_stream`` records an event and waits on it, and
    ``Stream.record_event`` records one: the call the schedule made is logged, not the calls
    it makes in turn. Streams are named by their handle (``cuda_stream``), events by object."""

    def __init__(self):
        self.log: list[tuple] = []
        self.depth = 0
        self.saved: list[tuple] = []

    def _wrap(self, owner, name: str, entry) -> None:
        original = getattr(owner, name)

        def logged(obj, *args, **kwargs):
            if self.depth == 0:
                self.log.append(entry(obj, *args, **kwargs))
            self.depth += 1
            try:
                return original(obj, *args, **kwargs)
            finally:
                self.depth -= 1

        self.saved.append((owner, name, original))
        setattr(owner, name, logged)

    def __enter__(self) -> CudaRecorder:
        cuda = torch.cuda
        current = lambda s: s if s is not None else cuda.current_stream()  # noqa: E731
        self._wrap(
            cuda.Stream, "wait_stream", lambda s, o: ("wait_stream", s.cuda_stream, o.cuda_stream)
        )
        self._wrap(cuda.Stream, "wait_event", lambda s, e: ("wait_event", s.cuda_stream, id(e)))
        self._wrap(
            cuda.Event,
            "record",
            lambda e, s=None: ("record_event", current(s).cuda_stream, id(e)),
        )
        self._wrap(
            cuda.Event, "wait", lambda e, s=None: ("wait_event", current(s).cuda_stream, id(e))
        )
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self.saved):
            setattr(owner, name, original)
        self.saved = []


def orders(config: Job, steps: int = 2, on: str = "fake") -> tuple[list, list]:
    """The optimized path's canonical logs of ``steps`` steps of ``config``: on the device
    (``on``: "fake" for the fake accelerator, "cuda" for a GPU) and with the stand-ins."""
    from twinshard.measure import fakecuda, memory
    from twinshard.measure.fakeaccel import runner

    config = replace(config, impl="optimized", foreach=True)
    if on == "fake":
        start = len(fakecuda.LOG)
        memory.record(config, steps)
        device_log = fakecuda.LOG[start:]
    else:
        with CudaRecorder() as recorder:
            runner.device_run(config, steps, on)
        device_log = recorder.log
    return canonical(device_log), canonical(standin_log(config, steps))


def standin_log(config: Job, steps: int) -> list[tuple]:
    """The stand-in streams' log of ``steps`` steps of ``config`` on the CPU (fake process
    group, real tensors)."""
    from twinshard.dispatch.standin import standin_streams
    from twinshard.measure.fakeaccel.runner import cpu_run
    from twinshard.optimized.streams import STANDIN_ENV

    log = standin_streams().log
    start = len(log)
    with mock.patch.dict(os.environ, {STANDIN_ENV: "1"}):  # restored as it was, after
        cpu_run(config, steps, None)
    return log[start:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="fake", help="fake (default) or cuda")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--hsdp", type=int, default=1, help="replicas of a 2D mesh")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    config = Job(
        impl="optimized", preset="tiny", seq=16, per_rank=2, dtype="bf16",
        world=args.world, replicas=args.hsdp,
    )  # fmt: skip
    device, standin = orders(config, args.steps, args.device)
    difference = first_difference(device, standin)
    print(
        f"optimized path, {args.steps} steps, world {args.world} ({args.hsdp} replicas): "
        f"{len(device)} stream entries on {args.device}, {len(standin)} with the stand-ins: "
        + ("the same order" if difference is None else f"they differ at {difference}")
    )
    return 0 if difference is None and device else 1


if __name__ == "__main__":
    sys.exit(main())
