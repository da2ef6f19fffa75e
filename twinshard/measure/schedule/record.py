"""Record one training step of any FSDP implementation from the outside.

``Recorder(model)`` attaches to a model that some ``fully_shard`` (twinshard's reference, its
optimized path, torch's own, or a variant of yours) has already sharded. Inside
``with recorder:`` it watches one forward and backward and produces a ``Schedule``: a list of
``Event`` (one per hook that the implementation ran) and of ``Collective`` (one per c10d
collective issued). It never calls into the implementation; it sees what a user could see:

- forward: a forward pre-hook and a forward hook on each sharded module, registered after
  the implementation's own, so they run right after its pre_forward and post_forward;
- pre_backward: a tensor hook on the module's outputs, registered after the implementation's
  hook on the same tensors, so it runs right after the implementation's pre_backward;
- post_backward: an identity autograd function wrapped around the module's inputs *before*
  the implementation wraps them (a prepended pre-hook), so in backward it runs after theirs;
- the end of backward: an autograd-engine callback queued behind the implementation's;
- collectives: a ``TorchDispatchMode`` (like ``twinshard.conformance.trace``) that sees each
  c10d operator of ``twinshard.dispatch.c10d``'s table, its tensors and its process group, and
  notices the first operator that reads a collective's result (for an asynchronous collective, the
  moment it had to be finished).

After each hook it notes the state of every parameter of every group (a sharded ``DTensor``,
an unsharded plain tensor, or freed) and the bytes alive in unsharded parameters (including
all-gather outputs in flight or still held) and in gradient buffers (unsharded ``.grad`` and
the inputs of reductions in flight or still held), apart from the sharded parameters and
gradients (counted on their own, even where a buffer became one: a shard group of one rank);
and, on an accelerator (the fake one included), all the bytes its allocator holds, which
adds the activations, the optimizer's state and every temporary. On the CPU nothing counts
those, so a CPU schedule has no such line. Which group a
collective carries is worked out by ``attribute.py`` from sizes and values, since the
collective itself only knows its tensors.
"""

from __future__ import annotations

import itertools
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from twinshard.dispatch import c10d

from .attribute import Attributor, GroupInfo, infer_post_forward_pieces, shard_size_of
from .buffers import CollectiveBuffers, storage_key
from .groups import find_groups
from .steps import Collective, Event, Schedule


class _AfterPostBackward(torch.autograd.Function):
    """Identity; its backward runs once the implementation's post-backward has run."""

    @staticmethod
    def forward(ctx, note, *inputs):
        ctx.note = note
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.note()
        return (None, *grads)


class _Watch(TorchDispatchMode):
    """Sees every operator: records collectives and the first read of their results."""

    def __init__(self, recorder: Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.recorder.busy or getattr(func, "namespace", "") == "profiler":
            pass  # the recorder's own arithmetic, or a profiler label: not part of the step
        elif (call := c10d.call(func, args, kwargs)) is not None:
            collective = self.recorder._issued(call)
            out = func(*args, **kwargs)
            self.recorder.buffers.keep_work(collective, out)
            return out
        elif not func.is_view:
            self.recorder._computed(args, kwargs)
        return func(*args, **kwargs)


class Recorder:
    """Watches the sharded modules of ``model``; ``with recorder:`` records one step."""

    def __init__(self, model: nn.Module, impl: str = ""):
        self.model, self.impl = model, impl
        kinds = {p.device.type for p in model.parameters()} - {"cpu", "meta"}
        self.accelerator = torch.get_device_module(kinds.pop()) if len(kinds) == 1 else None
        self.groups = find_groups(model)
        if not self.groups:
            raise ValueError("no module of this model was sharded with fully_shard")
        self.active, self.busy, self.handles = False, False, []
        self.shards: dict[tuple[str, str], list] = {}  # (group, param) -> its shards' storages
        self._note_shards()  # before the step, when every parameter is sharded
        for g in self.groups:
            self._attach(g)

    # --- hooks (each bound to its group's path with ``partial``) --------------------------------
    def _attach(self, g: GroupInfo) -> None:
        path = g.path
        wrap = partial(self._wrap_inputs, path)
        for m in g.modules:  # each module of the call: the hooks run for each one
            self.handles += [
                m.register_forward_pre_hook(wrap, prepend=True, with_kwargs=True),
                m.register_forward_pre_hook(partial(self._after_pre_forward, path)),
                m.register_forward_hook(partial(self._after_forward, path)),
            ]

    def _wrap_inputs(self, path: str, module, args, kwargs):
        if not (self.active and torch.is_grad_enabled()):
            return None
        top = list(args) + list(kwargs.values())  # nested tensors are not followed
        inputs = [t for t in top if isinstance(t, torch.Tensor) and t.requires_grad]
        if not inputs:
            return None  # its gradients are reduced at the end of backward instead
        note = partial(self._event, path, "post_backward")
        swapped = dict(zip(map(id, inputs), _AfterPostBackward.apply(note, *inputs)))
        swap = lambda v: swapped.get(id(v), v) if isinstance(v, torch.Tensor) else v  # noqa: E731
        return (tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()})

    def _after_pre_forward(self, path: str, module, args) -> None:
        if self.active:
            self._event(path, "pre_forward")

    def _after_forward(self, path: str, module, args, output) -> None:
        if not self.active:
            return
        self._event(path, "post_forward")
        fired = []

        def pre_backward(grad):
            if not fired:
                fired.append(True)
                self._queue_final_callback()
                self._event(path, "pre_backward")

        if torch.is_grad_enabled():
            for t in c10d.tensors(output):
                if t.requires_grad:
                    t.register_hook(pre_backward)

    def _queue_final_callback(self) -> None:
        # Queued twice over: by the time ours is queued the second time, the
        # implementation's own callback (queued by its first pre_backward) is ahead of it.
        if not self.callback_queued:
            self.callback_queued, self.phase = True, "backward"
            engine = Variable._execution_engine
            engine.queue_callback(lambda: engine.queue_callback(self._final_callback))

    def _final_callback(self) -> None:
        self.callback_queued = False
        self._event("", "final_callback")

    # --- recording -----------------------------------------------------------------------------
    def __enter__(self) -> Recorder:
        self.events, self.collectives, self.in_flight = [], [], {}
        self.buffers = CollectiveBuffers()
        self.ticks, self.phase, self.callback_queued = itertools.count(), "forward", False
        self.attributor = Attributor(self.groups)
        self.watch = _Watch(self)
        self.watch.__enter__()
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        self.active = False
        self.buffers.release()
        self.watch.__exit__(*exc)

    def remove(self) -> None:
        """Take every hook off the model."""
        for h in self.handles:
            h.remove()
        self.handles = []

    @property
    def schedule(self) -> Schedule:
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        s = Schedule(
            self.impl,
            rank,
            world,
            [g.path for g in self.groups],
            {g.path: [p[0] for p in g.params] for g in self.groups},
            list(self.events),
            list(self.collectives),
        )
        infer_post_forward_pieces(s, {g.path: g for g in self.groups})
        return s

    def _event(self, path: str, hook: str) -> None:
        self.busy = True
        try:
            self._snapshot(path, hook)
        finally:
            self.busy = False

    def _snapshot(self, path: str, hook: str) -> None:
        tick = next(self.ticks)
        states = {
            g.path: {
                name: self._state(getattr(owner, attr), g.sizes[name].shard_size)
                for name, owner, attr in g.params
            }
            for g in self.groups
        }
        unsharded, grads, sharded = self._memory()
        device = self.accelerator.memory_allocated() if self.accelerator is not None else None
        index = len(self.events)
        mine = [c for c in self.collectives if c.event is None]
        for c in mine:
            c.event = index
            self.attributor.resolve(c, path, self.phase)
        self.events.append(
            Event(
                index,
                tick,
                path,
                hook,
                self.phase,
                states,
                unsharded,
                grads,
                [c.index for c in mine],
                sharded,
                device,
            )
        )

    @staticmethod
    def _state(t: torch.Tensor, shard_size: int) -> str:
        if isinstance(t, DTensor):  # torch keeps a post-forward piece as a DTensor on fewer ranks
            return "P" if shard_size_of(t) < shard_size else "S"
        return "U" if storage_key(t) else "-"

    def _note_shards(self) -> None:
        """Remember the storages of every parameter the module shows sharded: its local shard
        and its sharded gradient's. An unsharded parameter keeps what was last seen: FSDP2
        still holds the shard it was gathered from."""
        for g in self.groups:
            for name, owner, attr in g.params:
                if isinstance(t := getattr(owner, attr), DTensor):
                    held = (t, t.grad)
                    kept = [storage_key(k._local_tensor) for k in held if isinstance(k, DTensor)]
                    self.shards[g.path, name] = [k for k in kept if k]

    def _memory(self) -> tuple[int, int, int]:
        """Bytes alive now: unsharded parameters, gradient buffers, sharded parameters and
        gradients (each storage once)."""
        params, grads = {}, {}
        self._note_shards()
        for g in self.groups:
            for _, owner, attr in g.params:
                t = getattr(owner, attr)
                if isinstance(t, DTensor):
                    continue  # counted with the shards
                params.update([storage_key(t) or (0, 0)])
                if t.grad is not None:
                    grads.update([storage_key(t.grad) or (0, 0)])
        # A collective's buffer (an all-gather's output, a gradient being reduced) counts while
        # the collective is in flight and, once its result was read, while the implementation
        # still holds it (the output of an all-gather not yet copied out, a buffer kept for the
        # next reduction, or one kept by mistake); not while only the backend does.
        gathered, reduced = self.buffers.held()
        params.update(gathered)  # (address, bytes) pairs
        grads.update(reduced)
        # With one rank per shard a reduction's buffer can become the sharded gradient itself:
        # memory that sharding keeps anyway, not a cost of the step.
        sharded = dict(k for kept in self.shards.values() for k in kept)
        alive = lambda found: sum(n for at, n in found.items() if at not in sharded)  # noqa: E731
        return alive(params), alive(grads), sum(sharded.values())

    def _issued(self, call: c10d.Call) -> Collective:
        side = max((call.outputs, call.inputs), key=lambda ts: sum(t.numel() for t in ts))
        exchanged = call.op != c10d.OPS[call.name].kind  # in place: the whole buffer it fills
        numel = call.numel if exchanged else sum(t.numel() for t in side)
        ranks = call.group.size() if call.group is not None else -1  # unknown: size unknown
        tick = next(self.ticks)
        c = Collective(
            len(self.collectives),
            call.op,
            str(side[0].dtype).removeprefix("torch."),
            numel * side[0].element_size(),
            ranks,
            call.blocking,
            tick,
            tick if call.blocking else None,
        )
        self.busy = True
        try:
            self.attributor.note_values(c, call.inputs, numel)
        finally:
            self.busy = False
        self.collectives.append(c)
        for t in call.outputs:
            if not call.blocking and (s := storage_key(t)):
                self.in_flight[s[0]] = c
        if call.op == "all_gather":
            self.buffers.watch(c, gathered=call.outputs)
        elif call.op == "reduce_scatter" or (
            call.op == "all_reduce" and side[0].is_floating_point()
        ):
            self.buffers.watch(c, reduced=call.inputs)  # gradients, being reduced
        return c

    def _computed(self, args, kwargs) -> None:
        """Any other operator: time moves on by one; does it read a collective's result?"""
        tick = next(self.ticks)
        for t in c10d.tensors((args, kwargs)) if self.in_flight else ():
            s = storage_key(t)
            if s and (c := self.in_flight.pop(s[0], None)) is not None:
                c.used_tick = tick
