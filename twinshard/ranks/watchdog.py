"""The watchdog: a run whose ranks stop making progress is stopped and the stalled rank named.

Every rank keeps a small record of what it is doing: the collective whose call is running (or
the last one issued), how many it has issued, the host sync it is blocked in, and its own
words from ``progress("step 12")``. A thread publishes that record a few times per timeout to
a store (the launcher's, or the one ``torchrun`` set up), with a heartbeat counter and whether
this rank's collectives return once queued on a device stream (nccl and the like) or once done
(gloo, mpi: ``twinshard.ranks.devices.collectives_return_when_queued``). A detector
(``twinshard.ranks.stall``) reads all the records: when no rank's record has changed for
``hang_timeout`` seconds, the run has stalled. It names the ranks whose heartbeat stopped
too; else, where collectives are queued, the ranks that issued the fewest (a hang there
surfaces at the next host sync, outside any collective call); else the ranks outside any
collective while the others wait in one, or those behind the others. Then every rank's
Python stack is dumped with ``faulthandler`` (on ``STACK_SIGNAL``, which needs no cooperation
from the stuck thread) and the run is stopped: by the launcher (``twinshard.ranks.launch``, its side
in ``supervise.py``), or, under ``torchrun``, by the ranks themselves (``start_torchrun``).

[Note: how collectives are seen] ``install_hooks`` wraps the collectives of
``torch.distributed`` (its functional collectives, ``Work.wait`` and the functional
collectives' ``wait_tensor``) in place, and
rebinds every module-level alias of them that an already imported module holds (such as
``_all_gather = dist.all_gather_into_tensor``); modules imported later bind the wrappers. A
wrapper only counts and names the call, so one costs about a microsecond per collective.
A rank counts as inside a collective while its Python call runs: on gloo that is until the
collective is done, on nccl only until it is queued.
A phase without any collective or ``progress`` call that lasts longer than ``hang_timeout``
(writing a huge checkpoint to slow storage) is reported as a stall: raise the timeout for it.

[Note: how host syncs are seen] Where a rank has an accelerator, ``install_sync_hooks`` also
wraps the calls that block the host until the device is done (``Tensor.item``,
``torch.accelerator.synchronize``, the device module's ``synchronize`` and its ``Event`` and
``Stream`` ``synchronize``), so that a rank hung behind a queued collective is reported
"blocked in a host sync, Tensor.item". A wrapper only names the call: about 0.1 us more per call
(``Tensor.item`` of a CPU scalar 0.11-0.14 -> 0.24-0.27 us, an empty function 0.02 -> 0.10
us; best of 9 ``timeit`` runs on a shared 2-core CPU box), against a host sync that costs
microseconds at least on a device. Installed only while the watchdog is on, and only where
the rank has an accelerator.
"""

from __future__ import annotations

import faulthandler
import functools
import json
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from . import devices
from .stall import Detector, publish_interval

__all__ = [
    "DEFAULT_HANG_TIMEOUT",
    "Detector",
    "install_hooks",
    "install_sync_hooks",
    "progress",
    "remove_sync_hooks",
    "snapshot",
    "start_torchrun",
]

DEFAULT_HANG_TIMEOUT = 300.0  # seconds; a healthy FSDP step makes progress many times a second
STACK_SIGNAL = signal.SIGUSR1  # ranks dump every thread's stack on it (faulthandler)
PREFIX = "twinshard-watchdog/"  # store keys: rank{r} (the record), abort (the verdict)
_C10D = (
    "all_reduce all_gather all_gather_into_tensor all_gather_single reduce_scatter "
    "reduce_scatter_tensor reduce_scatter_single broadcast barrier monitored_barrier "
    "all_to_all all_to_all_single reduce gather scatter send recv broadcast_object_list "
    "all_gather_object gather_object scatter_object_list batch_isend_irecv"
).split()
_FUNCOL = "all_reduce all_gather_tensor reduce_scatter_tensor all_to_all_single broadcast".split()


class _Record:
    """What this rank is doing. Written by the rank's own threads, read by the publisher;
    a torn read only blurs one report, so there is no lock."""

    def __init__(self) -> None:
        self.events = 0  # bumps on entering and leaving a collective, and on progress()
        self.issued = 0  # collectives issued so far
        self.depth = 0  # > 0 while inside a collective
        self.op = ""  # the collective waited in, or the last one
        self.last_async = ""  # the last collective issued with async_op=True
        self.what = "starting"  # the rank's own words, from progress()
        self.sync = ""  # the host sync running now ("Tensor.item"), else ""


_RECORD = _Record()


def progress(what: str) -> None:
    """Say what this rank is doing ("step 12", "saving a checkpoint"); counts as progress."""
    _RECORD.what = what
    _RECORD.events += 1


def _enter(op: str) -> None:
    r = _RECORD
    r.depth += 1
    r.events += 1
    r.op = op


def _leave() -> None:
    _RECORD.depth -= 1
    _RECORD.events += 1


def _tracked(name: str, fn):
    @functools.wraps(fn)
    def collective(*args, **kwargs):
        _RECORD.issued += 1
        op = f"{name} #{_RECORD.issued}"
        if kwargs.get("async_op") or name.startswith("functional "):  # funcol's never block
            _RECORD.last_async = op
        _enter(op)
        try:
            return fn(*args, **kwargs)
        finally:
            _leave()

    collective.__twinshard_watched__ = fn
    return collective


def install_hooks() -> None:
    """Wrap the collectives so that entering and leaving them counts as progress (once)."""
    import torch.distributed._functional_collectives as funcol
    from torch._C._distributed_c10d import Work
    from torch.distributed import distributed_c10d as c10d

    if hasattr(Work.wait, "__twinshard_watched__"):
        return
    wrappers = {}  # id(original) -> wrapper
    for module, names, label in ((c10d, _C10D, ""), (funcol, _FUNCOL, "functional ")):
        for name in names:
            original = getattr(module, name, None)
            if callable(original) and not hasattr(original, "__twinshard_watched__"):
                wrappers[id(original)] = (original, _tracked(label + name, original))
    for module in list(sys.modules.values()):  # rebind aliases, dist.* included
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for key, value in list(namespace.items()):
            found = wrappers.get(id(value))
            if found is not None and found[0] is value:
                namespace[key] = found[1]
    wait = Work.wait

    @functools.wraps(wait)
    def watched_wait(self, *args, **kwargs):
        # Inside a blocking collective the wait is that collective's own: keep its name.
        op = _RECORD.op if _RECORD.depth else f"wait for {_RECORD.last_async or 'a collective'}"
        _enter(op)
        try:
            return wait(self, *args, **kwargs)
        finally:
            _leave()

    watched_wait.__twinshard_watched__ = wait
    Work.wait = watched_wait
    _watch_functional_wait(funcol)


def _watch_functional_wait(funcol) -> None:
    """A functional collective returns at once; its rank blocks later, in ``wait_tensor``
    (``AsyncCollectiveTensor`` calls it through the module, as DTensor's reductions and
    ``clip_grad_norm_`` over DTensors do). That wait is a collective's as much as ``Work.wait``."""
    wait_tensor = funcol.wait_tensor

    @functools.wraps(wait_tensor)
    def watched_wait_tensor(tensor):
        _enter(f"wait for {_RECORD.last_async or 'a functional collective'}")
        try:
            return wait_tensor(tensor)
        finally:
            _leave()

    watched_wait_tensor.__twinshard_watched__ = wait_tensor
    for module in list(sys.modules.values()):  # funcol's own global, and any alias of it
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get("wait_tensor") is wait_tensor:
            namespace["wait_tensor"] = watched_wait_tensor


def _host_syncs() -> list[tuple[object, str, str]]:
    """(owner, attribute, label) of each call that blocks the host until the device is done."""
    found = [
        (torch.Tensor, "item", "Tensor.item"),
        (torch.accelerator, "synchronize", "torch.accelerator.synchronize"),
    ]
    accelerator = torch.accelerator.current_accelerator()
    for kind in sorted({"cuda"} | ({accelerator.type} if accelerator else set())):
        module = getattr(torch, kind, None)
        found.append((module, "synchronize", f"torch.{kind}.synchronize"))
        for name in ("Event", "Stream"):
            found.append(
                (getattr(module, name, None), "synchronize", f"torch.{kind}.{name}.synchronize")
            )
    return [(owner, attr, label) for owner, attr, label in found if owner is not None]


def _in_host_sync(label: str, fn):
    @functools.wraps(fn)
    def host_sync(*args, **kwargs):
        record = _RECORD
        outer, record.sync = record.sync, label
        try:
            return fn(*args, **kwargs)
        finally:
            record.sync = outer

    host_sync.__twinshard_watched__ = fn
    return host_sync


_SYNC_HOOKS: list[tuple[object, str, bool, object]] = []  # owner, name, had its own, original


def install_sync_hooks() -> None:
    """Wrap the host syncs so that the record names the one a rank is blocked in (once;
    see [Note: how host syncs are seen])."""
    if _SYNC_HOOKS:
        return
    for owner, name, label in _host_syncs():
        original = getattr(owner, name, None)
        if not callable(original) or hasattr(original, "__twinshard_watched__"):
            continue
        own = name in vars(owner)
        try:
            setattr(owner, name, _in_host_sync(label, original))
        except (AttributeError, TypeError):  # a type that cannot be changed: not seen
            continue
        _SYNC_HOOKS.append((owner, name, own, original))


def remove_sync_hooks() -> None:
    """Put the host syncs back as they were."""
    while _SYNC_HOOKS:
        owner, name, own, original = _SYNC_HOOKS.pop()
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)  # it was inherited: inherit it again


# ------------------------------------------------------------------------ the rank's side
def _queued() -> bool:
    try:
        return devices.collectives_return_when_queued()
    except Exception:  # the group is being destroyed: nothing to say about it
        return False


def snapshot(beat: int) -> dict:
    """This rank's record as published: a JSON-able dict (``twinshard.ranks.stall`` reads it)."""
    r = _RECORD
    return dict(
        events=r.events,
        issued=r.issued,
        inside=r.depth > 0,
        op=r.op,
        what=r.what,
        sync=r.sync,
        queued=_queued(),
        beat=beat,
        pid=os.getpid(),
        host=socket.gethostname(),
    )


class _Publisher(threading.Thread):
    """Writes this rank's record to the store every ``interval`` seconds, with a heartbeat."""

    def __init__(self, store, rank: int, interval: float, on_abort=None):
        super().__init__(name="twinshard-watchdog-publisher", daemon=True)
        self.store, self.rank, self.interval, self.on_abort = store, rank, interval, on_abort
        self.beat = 0

    def run(self) -> None:
        while True:
            self.beat += 1
            try:
                self.store.set(f"rank{self.rank}", json.dumps(snapshot(self.beat)))
                if self.on_abort and self.store.check(["abort"]):
                    self.on_abort(self.store.get("abort").decode())
            except Exception:  # the store is gone: the run is over, or will be soon
                pass
            time.sleep(self.interval)


def start_rank(store, rank: int, hang_timeout: float, stack_file=None, on_abort=None) -> None:
    """Watch this rank: hooks, a stack dump on ``STACK_SIGNAL``, the publisher thread."""
    install_hooks()
    if devices.accelerator_type() is not None:
        install_sync_hooks()
    faulthandler.register(STACK_SIGNAL, file=stack_file or sys.stderr, all_threads=True)
    _Publisher(store, rank, publish_interval(hang_timeout), on_abort).start()


# ------------------------------------------------------------------------------ torchrun
def start_torchrun(hang_timeout: float) -> None:
    """Watch this rank of a ``torchrun`` job: publish its record and, on two ranks, detect.

    A stall is written to the store; every rank that still runs dumps its stack to stderr
    and exits with status 1, and ``torchrun`` then stops the job. Uses a client of its own to
    ``MASTER_ADDR:MASTER_PORT``, so a short timeout never touches the process group's store.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=max(10.0, hang_timeout)),
    )
    store = dist.PrefixStore(f"{PREFIX}{attempt}/", client)

    def abort(message: str) -> None:
        sys.stderr.write(f"twinshard watchdog: rank {rank} stops; stack:\n")
        faulthandler.dump_traceback(sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(1)

    start_rank(store, rank, hang_timeout, on_abort=abort)
    if rank in {0, world - 1}:  # two detectors: one of them is not the stopped rank
        threading.Thread(
            target=_detect_forever,
            args=(store, world, hang_timeout),
            name="twinshard-watchdog-detector",
            daemon=True,
        ).start()


def _detect_forever(store, world: int, hang_timeout: float) -> None:
    detector = Detector(store, world, hang_timeout)
    while True:
        time.sleep(publish_interval(hang_timeout))
        try:
            stall = detector.check()
        except Exception:
            continue
        if stall is not None:
            if store.add("verdicts", 1) == 1:  # the first detector speaks for the run
                sys.stderr.write(f"twinshard watchdog: {stall.headline}\n")
                sys.stderr.flush()
                store.set("abort", stall.headline)
            return
