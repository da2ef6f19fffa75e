"""A simulated network: one process stands in for rank 0 of a world of W ranks.

``Link`` is the one link model (a bandwidth, a latency per collective and one per step of the
ring) and ``Link.seconds`` the time of one collective on it; ``twinshard plan``'s networks use
it too. ``SimProcessGroup`` is the process group, registered by ``register`` under the
``"simnet"`` backend and started by ``init(world_size, link)``. Each collective goes through
``_issue``, which logs a ``Call`` in the ``Network`` (``network()``: the link, the log, the
optional observer to tell) and either hands the collective to its group's ``_Wire``, a thread
that completes collectives one after the other at their simulated end, or, on a GPU, writes
the values at once and sleeps on the stream (``_gpu_sleep``). A Python process group is called
directly by ``torch.distributed``, so neither the dispatcher nor ``conformance.trace`` sees
it: ``network().calls`` is how the benchmark counts collectives.

[Note: the simulated network on an accelerator]
On a GPU a collective is a kernel that keeps its stream busy, not a future that completes
late: there ``_issue`` writes the values at once, the stream spins for the link's time, and
the work handle is complete when returned (no wire thread). What that changes for a reader of
the numbers is on the page below. (Written for the day a GPU is lent; CI has none.)

The link model, the values a collective returns and how they read: docs/benchmarks.md, "The
simulated network".
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

BACKEND = "simnet"


@dataclass(frozen=True)
class Link:
    """One rank's connection: its bandwidth, a latency per collective and one per step of the
    ring (NCCL's latency model; 0 on the simulated links)."""

    name: str
    bandwidth: float  # bytes/s that one rank sends (NCCL's "bus bandwidth")
    latency_s: float  # per collective (NCCL's base latency)
    per_step_s: float = 0.0  # per step of the ring

    def seconds(self, op: str, nbytes: int, size: int) -> float:
        """How long ``op`` on ``nbytes`` over ``size`` ranks takes (docs/benchmarks.md, "The
        simulated network")."""
        if size <= 1:
            return 0.0
        steps = 2 * (size - 1) if op == "all_reduce" else size - 1
        wire = wire_bytes(op, nbytes, size)
        return self.latency_s + steps * self.per_step_s + wire / self.bandwidth


# Typical bus bandwidths that NCCL reaches for large messages: NVLink within an H100 node,
# and one 400 Gb/s InfiniBand NIC per GPU across nodes.
LINKS = {"nvlink": Link("nvlink", 350e9, 10e-6), "ib": Link("ib", 45e9, 20e-6)}


def parse_link(text: str, latency_us: float | None = None) -> Link:
    """``nvlink``, ``ib``, ``inf`` (instant), or a bandwidth in GB/s (e.g. ``"2"``, with 20 us
    of latency); ``latency_us`` overrides the latency."""
    if text in LINKS:
        link = LINKS[text]
    elif text == "inf":
        link = Link("instant", float("inf"), 0.0)  # communication takes no time at all
    else:
        try:
            gbps = float(text)
        except ValueError:
            raise ValueError(f"--link: use {' or '.join(LINKS)} or a bandwidth in GB/s") from None
        if gbps <= 0:
            raise ValueError(f"--link: the bandwidth must be positive, got {text}")
        link = Link(f"{text} GB/s", gbps * 1e9, 20e-6)
    return link if latency_us is None else replace(link, latency_s=latency_us * 1e-6)


def wire_bytes(op: str, nbytes: int, size: int) -> float:
    """Bytes one rank sends for ``op`` over ``size`` ranks (ring algorithms)."""
    if size <= 1:
        return 0.0
    share = (size - 1) / size
    factor = {"all_gather": share, "reduce_scatter": share, "all_reduce": 2 * share}.get(op, 1.0)
    return factor * nbytes


@dataclass
class Call:
    op: str
    dtype: torch.dtype
    numel: int  # of the larger side, as in conformance.trace
    group_size: int
    wire_bytes: float
    issued: float  # time.perf_counter() when issued
    start: float  # when the wire was free for it
    end: float  # when it completes


@dataclass
class Network:
    """The link, the log of collectives, and one wire per process group."""

    link: Link
    calls: list = field(default_factory=list)
    fill: bool = True  # write the values (docs/benchmarks.md, "The simulated network")
    observer: Any = None  # called with (op, tensors) at every collective (Monitor.saw)


_NETWORK: Network | None = None


def network() -> Network:
    if _NETWORK is None:
        raise RuntimeError("the simulated network is not running: call simnet.init first")
    return _NETWORK


class _Wire:
    """One process group's collectives, completed in order by a daemon thread."""

    def __init__(self):
        self.free_at = 0.0
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True, name="simnet-wire").start()

    def submit(self, end: float, fill, future: Future, result) -> None:
        self.jobs.put((end, fill, future, result))

    def _run(self) -> None:
        while True:
            end, fill, future, result = self.jobs.get()
            if fill is not None:
                with torch.no_grad():
                    fill()
            delay = end - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            future.set_result(result)
            # the job's tensors must not outlive it while the thread waits for the next one
            del end, fill, future, result


class SimProcessGroup(dist.ProcessGroup):
    """A process group of ``size`` ranks of which this process is ``rank``; see the module
    docstring for what each collective does and how long it takes."""

    def __init__(self, rank: int, size: int, name: str):
        super().__init__(rank, size)
        self._rank, self._size, self._name = rank, size, name
        self._wire = _Wire()

    def size(self) -> int:
        return self._size

    @property
    def group_name(self) -> str:  # torch registers the name on C++ groups only
        return self._name

    def getBackendName(self) -> str:
        return BACKEND

    def _issue(self, op: str, tensors: list, fill, result) -> dist.Work:
        net = network()
        big = max(tensors, key=lambda t: t.numel())
        nbytes = big.numel() * big.element_size()
        now = time.perf_counter()
        start = max(now, self._wire.free_at)
        end = start + net.link.seconds(op, nbytes, self._size)
        self._wire.free_at = end
        wire = wire_bytes(op, nbytes, self._size)
        net.calls.append(Call(op, big.dtype, big.numel(), self._size, wire, now, start, end))
        if net.observer is not None:
            net.observer(op, tensors)
        future = Future()
        if big.is_cuda or (end <= now and self._wire.jobs.empty()):  # a GPU, or an instant link
            if net.fill and fill is not None:
                with torch.no_grad():
                    fill()
            if big.is_cuda:  # see [Note: the simulated network on an accelerator]
                _gpu_sleep(end - start)
            future.set_result(result)
        else:
            self._wire.submit(end, fill if net.fill else None, future, result)
        return _create_work_from_future(future)

    def _factor(self, opts) -> int:
        summed = getattr(opts, "reduceOp", dist.ReduceOp.SUM) == dist.ReduceOp.SUM
        return self._size if summed else 1

    # --- all-gather -------------------------------------------------------------------------
    def all_gather_single(self, output, input, opts=None):
        def fill():
            src = input.reshape(1, -1)
            if src.untyped_storage().data_ptr() == output.untyped_storage().data_ptr():
                src = src.clone()  # gathered in place (torch's fully_shard): input is a slot
            output.view(self._size, -1).copy_(src)

        return self._issue("all_gather", [output, input], fill, [output])

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        # one collective per pair on the one wire: the last one's work ends after all of them
        return [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)][-1]

    def allgather(self, output_lists, inputs, opts=None):
        outs = [o for lst in output_lists for o in lst]

        def fill():
            for lst, i in zip(output_lists, inputs):
                for o in lst:
                    o.copy_(i)

        return self._issue("all_gather", outs + list(inputs), fill, output_lists)

    allgather_coalesced = allgather

    # --- reduce-scatter ---------------------------------------------------------------------
    def reduce_scatter_single(self, output, input, opts=None):
        k = self._factor(opts)

        def fill():
            block = input.reshape(self._size, -1)[self._rank]  # this rank's block
            output.view(-1).copy_(block).mul_(k)

        return self._issue("reduce_scatter", [output, input], fill, [output])

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)][-1]

    def reduce_scatter(self, outputs, input_lists, opts=None):
        k = self._factor(opts)

        def fill():
            for o, lst in zip(outputs, input_lists):
                o.copy_(lst[self._rank]).mul_(k)

        ins = [i for lst in input_lists for i in lst]
        return self._issue("reduce_scatter", list(outputs) + ins, fill, outputs)

    # --- all-reduce, broadcast, barrier -------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        k = self._factor(opts)

        def fill():
            for t in tensors:
                if k != 1:
                    t.mul_(k)

        return self._issue("all_reduce", list(tensors), fill, list(tensors))

    allreduce_coalesced = allreduce

    def broadcast(self, tensors, opts=None):
        return self._issue("broadcast", list(tensors), None, list(tensors))

    def barrier(self, opts=None):
        return self._issue("barrier", [torch.zeros(1)], None, [])

    # torch before 2.13 calls a Python group's single-tensor collectives by their old names (the
    # GPU image's torch 2.11 does): without these it looks for a C++ backend and finds none
    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced


_CYCLES_PER_S: float | None = None


def _gpu_sleep(seconds: float) -> None:
    """Keep the current stream busy for ``seconds`` (calibrated once against CUDA events)."""
    global _CYCLES_PER_S
    if _CYCLES_PER_S is None:
        begin, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 20_000_000
        begin.record()
        torch.cuda._sleep(cycles)
        done.record()
        done.synchronize()
        _CYCLES_PER_S = cycles / (begin.elapsed_time(done) / 1000)
    if seconds > 0:
        torch.cuda._sleep(int(seconds * _CYCLES_PER_S))


def _create(opts, backend_opts) -> SimProcessGroup:
    return SimProcessGroup(opts.group_rank, opts.group_size, opts.group_id)


def register() -> None:
    """Make ``"simnet"`` a backend name for ``init_process_group`` (once per process)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


def init(world_size: int, link: Link, fill: bool = True) -> Network:
    """Start ``torch.distributed`` as rank 0 of ``world_size`` ranks on the simulated link."""
    global _NETWORK
    register()
    _NETWORK = Network(link, fill=fill)
    dist.init_process_group(BACKEND, rank=0, world_size=world_size, store=dist.HashStore())
    return _NETWORK
