"""What one training step did, recorded for the plan: operators, streams, collectives, memory.

``StepTrace`` is the fake-accelerator run's ``Monitor`` (host syncs, host collectives, the
collectives, the device's bytes) with what a plan needs on top, recorded only between
``start`` and ``stop`` (the measured step): ``entries``, the step in the order the host issued
it, for ``replay.py``, each carrying its ``labels.Labels`` place; ``memory``, the live bytes
sampled whenever a storage is made, and the operator after which they peaked. ``arm(index)``
makes the next step, which repeats the measured one operator for operator, stop after that
operator and sort the device's live storages (``parts_at_peak``); ``made_by_fsdp`` tells a
buffer of the FSDP implementation's own code from the model's.

Why the parts are taken a step later: looking at every peak as it happens would cost a look at
every parameter after nearly every operator of a forward (activations only grow there): hours
for a 70B model.

[Note: torch's copies are priced]
torch's ``fully_shard`` copies through operators of its own (``fsdp::``), whose copies a
dispatch mode does not see (on fake tensors one copies nothing): each is priced as the bytes it
reads and writes (``fsdp_copy_bytes``). Why, and what it changed: docs/plan.md.

[Note: a DTensor is priced by its local tensor]
An operator on ``DTensor`` arguments reaches the dispatch mode before ``DTensor`` hands it to
its local tensors, so its arguments show the global shape: the optimizer's one fused AdamW over
the sharded parameters looked as large as the unsharded model's, world-size times what the
rank's device moves (8x on 8 ranks: 16 ms where the ideal step's optimizer over the same shards
took 2.3 ms, in the plan of a 4-block Llama 3.1 8B on 8 H100s). The local computation is not
seen on its own, so each ``DTensor`` is priced as its local tensor (``local_tensors``), in bytes
and in FLOPs.

What is recorded and how the parts are sorted: docs/plan.md, "How the time is predicted" and
"How the memory's parts are found".
"""

from __future__ import annotations

import itertools
import sys
import weakref
from collections import Counter

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.flop_counter import flop_registry

from twinshard.dispatch import c10d
from twinshard.measure import fakecuda
from twinshard.measure.monitor import Monitor
from twinshard.measure.probe import CATEGORIES, Probe

aten = torch.ops.aten

# operators that move no data: bookkeeping, or a buffer whose contents nobody wrote yet
FREE = set(
    "empty empty_like empty_strided new_empty new_empty_strided detach alias lift_fresh set_ "
    "resize_ record_stream _local_scalar_dense is_pinned device _to_copy_meta".split()
)
# files whose code is an FSDP implementation: what they make is FSDP's, not the model's
FSDP_CODE = ("/fsdp/_fully_shard/", "/twinshard/reference/", "/optimized/", "/reference/")
# the scaled-dot-product-attention kernels and where their ``is_causal`` argument is
CAUSAL_ARG = {
    aten._scaled_dot_product_flash_attention.default: 4,
    aten._scaled_dot_product_flash_attention_backward.default: 11,
    aten._scaled_dot_product_efficient_attention.default: 5,
    aten._scaled_dot_product_efficient_attention_backward.default: 11,
}
PARTS = CATEGORIES + ("fsdp_buffers", "activations")


def made_by_fsdp() -> bool:
    """Whether the operator running now was called from an FSDP implementation's code."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if any(part in name for part in FSDP_CODE) and "/twinshard/measure/plan/" not in name:
            return True
        frame = frame.f_back
    return False


def fsdp_copy_bytes(name: str, func, args, kwargs) -> int:
    """The bytes read and written by one of the copies torch's ``fully_shard`` makes through
    operators of its own (``fsdp::``), 0 for another. [Note: torch's copies are priced]"""
    bound = c10d.arguments(func, args, kwargs)
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    if name == "all_gather_copy_in":  # the shards into this rank's slot of the output
        shards = bound["all_gather_inputs"]
        return size(shards) + sum(s.numel() for s in shards) * bound["all_gather_output"].itemsize
    if name == "split_with_sizes_copy":  # the gathered output into the parameters
        return size([bound["all_gather_output"]]) + size(bound["out"])
    if name == "chunk_cat":  # the gradients into the reduce-scatter input
        return size(bound["tensors"]) + size([bound["out"]])
    return 0


def operator_bytes(func, args, kwargs, out) -> tuple[int, list]:
    """The bytes an ATen operator reads and writes, and those tensors (its tensor arguments
    and results). An ``out=`` argument is only written: where the operator returns
    it as well it counts once, there, as the functional form's result would (an in-place
    operator's ``self``, read and written, counts twice)."""
    returns = bool(func._schema.returns)
    written = {a.name for a in func._schema.arguments if a.is_out and returns}
    read = (args, {k: v for k, v in kwargs.items() if k not in written})
    tensors = [t for t in tree_leaves((read, out)) if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors), tensors


def local_tensors(tree):
    """``tree`` with each ``DTensor`` replaced by its local tensor, what this rank's device
    reads and writes; see [Note: a DTensor is priced by its local tensor]."""
    return tree_map_only(DTensor, lambda t: t._local_tensor, tree)


class StepTrace(Monitor):
    """See the module docstring. ``accelerator``: the device type of the run ("cpu" for the
    CPU target); ``labels``: a ``labels.Labels`` that says where the step is."""

    def __init__(self, accelerator: str, labels, probe=None):
        super().__init__(accelerator, probe)
        self.labels = labels
        self.recording = False
        # what ``parts_at_peak`` looks at: the model, its optimizer, and the modules that hold
        # sharded parameters (found while all are sharded: an unsharded one holds none)
        self.model, self.optimizer, self.modules = None, None, []
        self.operators = 0  # dispatched in the current phase
        self.peak_operator = -1  # after which operator the recorded step peaked
        self.armed = -1  # the operator after which to take the snapshot (-1: none)
        self.snapshot_bytes = 0
        self.shards: list = []  # weak references to the shards, taken by ``arm``
        self.entries: list[tuple] = []
        self.collective_info: list[dict] = []  # per collective entry: op, bytes, group, ...
        self.timeline: list[tuple[int, int, str]] = []  # (entry index, live bytes, label)
        self.snapshot: dict = {}  # at the device's peak: serial -> (bytes, roles)
        self.serials: dict[int, int] = {}  # storage key -> serial, while it lives
        self.fsdp_made: set[int] = set()  # serials of storages FSDP code made
        self.collective_serials: set[int] = set()  # serials a collective used this step
        self.works: dict[int, int] = {}  # id(Work) -> its collective's entry index
        self.issued = None  # the collective the operator dispatched now issued
        self.flops = Counter()  # by label kind: forward, backward, recompute, optimizer
        self._count_serial = itertools.count()
        self.alloc_log = [] if accelerator != "cpu" else None  # see Monitor.live_bytes
        self._log_mark = len(fakecuda.LOG)
        self._sync_mark = len(fakecuda.SYNCS)

    # --- recording on and off ---------------------------------------------------------------
    def begin(self, name: str):
        self.operators = 0
        return super().begin(name)

    def start(self) -> None:
        """Record from here (the measured step begins)."""
        self.recording = True
        self._log_mark, self._sync_mark = len(fakecuda.LOG), len(fakecuda.SYNCS)

    def arm(self, operator: int) -> None:
        """Take the snapshot of the parts after ``operator`` of the phase that begins next.

        Called between steps, where every parameter is sharded: the shards are remembered
        now, since at the peak a group that keeps its parameters after forward (the root)
        shows its unsharded ones and its shards only through the implementation's state."""
        from torch.distributed.tensor import DTensor

        self.armed = operator
        self.shards = [
            weakref.ref(p._local_tensor) for p in self.model.parameters() if isinstance(p, DTensor)
        ]

    def stop(self) -> None:
        self._flush()
        self.recording = False
        self.works.clear()

    # --- entries ------------------------------------------------------------------------------
    def _flush(self) -> None:
        """Append the streams' waits and events and the explicit syncs made since the last
        operator, in the order they happened (each list is in order; they interleave only
        between operators)."""
        if not self.recording:
            return
        for kind, stream, other in fakecuda.LOG[self._log_mark :]:
            self.entries.append((kind, stream, other))
        self._log_mark = len(fakecuda.LOG)
        for what, _ in fakecuda.SYNCS[self._sync_mark :]:
            self.entries.append(("sync", what, None))
        self._sync_mark = len(fakecuda.SYNCS)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.operators += 1
        if not self.recording:
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if self.operators == self.armed:
                self._take_snapshot()
            return out
        self._flush()
        syncs = len(self.phase.syncs)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        stream = fakecuda.current_stream().name if self.accelerator != "cpu" else "host"
        label = self.labels.now
        if self.issued is not None:  # held for this operator only: it holds the buffers
            call, self.issued = self.issued, None
            self._record_collective(call, out, stream, label)
        elif len(self.phase.syncs) > syncs:
            self.entries.append(("host_sync", stream, label))
        self._record_operator(func, args, kwargs, out, stream, label)
        return out

    def _record_operator(self, func, args, kwargs, out, stream, label) -> None:
        name, namespace = func.__name__.split(".")[0], getattr(func, "namespace", "")
        if namespace == "fsdp" and (moved := fsdp_copy_bytes(name, func, args, kwargs)):
            self.entries.append(("op", stream, label, 0, moved, "torch.float32", False))
        if namespace != "aten" or name in FREE or func.is_view:
            return
        args, kwargs, out = local_tensors((args, kwargs, out))
        flops = 0
        counter = flop_registry.get(func._overloadpacket)
        if counter is not None:
            flops = counter(*args, **kwargs, out_val=out)
            self.flops[self.labels.kind] += flops
        index = CAUSAL_ARG.get(func)
        causal = index is not None and len(args) > index and bool(args[index])
        moved, tensors = operator_bytes(func, args, kwargs, out)
        copy = "host_copy" if len({t.device.type for t in tensors}) > 1 else "op"
        dtype = str(out.dtype if isinstance(out, torch.Tensor) else tensors[0].dtype)
        if flops == 0 and moved == 0:
            return
        self.entries.append((copy, stream, label, flops, moved, dtype, causal))

    def _record_collective(self, call: c10d.Call, out, stream, label) -> None:
        index = len(self.entries)
        self.collective_info.append(
            dict(
                op=call.op,
                dtype=call.dtype,
                bytes=call.nbytes,
                ranks=call.ranks(),
                group=id(call.group),
                label=label,
                stream=stream,
            )
        )
        self.entries.append(("collective", stream, len(self.collective_info) - 1))
        self._note_collective_tensors(call)
        work = out[-1] if isinstance(out, (tuple, list)) and out else None
        if isinstance(work, torch.ScriptObject):
            # by identity, not kept alive (a work handle can keep the collective's tensors
            # alive, which would change the memory being measured): a handle freed before
            # anyone waited on it cannot be waited on, and a new one at its address replaces it
            unboxed = torch._C._distributed_c10d.Work.unbox(work)
            self.works[id(unboxed)] = index

    def _note_collective_tensors(self, call: c10d.Call) -> None:
        for t in call.tensors:
            serial = None if t.is_meta else self.serials.get(t.untyped_storage()._cdata)
            if serial is not None:
                self.collective_serials.add(serial)

    def _collective(self, call: c10d.Call) -> None:
        super()._collective(call)
        if self.recording:
            self.issued = call
        else:  # the snapshot's step: which buffers collectives use
            self._note_collective_tensors(call)

    def waited(self, work) -> None:
        """``Work.wait()`` was called on ``work`` (see ``runner.watch_waits``)."""
        if self.recording and id(work) in self.works:
            self._flush()
            stream = fakecuda.current_stream().name if self.accelerator != "cpu" else "host"
            collective = self.entries[self.works[id(work)]][2]
            self.entries.append(("wait_work", stream, collective))

    # --- memory ---------------------------------------------------------------------------------
    def _hold(self, t: torch.Tensor) -> bool:
        new = super()._hold(t)
        if new:
            serial = next(self._count_serial)
            self.serials[t.untyped_storage()._cdata] = serial
            if made_by_fsdp():
                self.fsdp_made.add(serial)
        return new

    def _count(self) -> None:
        before = self.phase.peak_bytes
        super()._count()
        if not self.recording:
            return
        now = fakecuda.MEMORY["allocated"]  # what Monitor._count just summed for the device
        self.timeline.append((len(self.entries), now, self.labels.now))
        if self.phase.peak_bytes > before:
            self.peak_operator, self.peak_label = self.operators, self.labels.now

    def _take_snapshot(self) -> None:
        """What every live storage of the device is, now (docs/plan.md, the memory's parts)."""
        roles = Probe(self.model, self.optimizer, self.modules).roles(self.shards)
        snap = {}
        for key, (storage, kind) in self.storages.items():
            if kind != self.accelerator or torch._C._storage_Use_Count(key) <= 1:
                continue
            snap[self.serials.get(key)] = (storage.nbytes(), roles.get(key))
        self.snapshot = snap
        self.snapshot_bytes = sum(n for n, _ in snap.values())

    def parts_at_peak(self) -> dict[str, int]:
        """The device's bytes at its peak, by part (docs/plan.md, the memory's parts)."""
        parts = dict.fromkeys(PARTS, 0)
        for serial, (nbytes, role) in self.snapshot.items():
            if role is None:
                if serial in self.collective_serials:
                    role = "comm"
                elif serial in self.fsdp_made:
                    role = "fsdp_buffers"
                else:
                    role = "activations"
            parts[role] += nbytes
        return parts
