"""What the optimized path's parameter groups share: streams, work in flight, buffer lifetimes.

One ``CommContext`` per root module, shared by all its parameter groups. It owns the side
streams and the state that must outlive one group's hook: the reduce-scatter whose gradients
are not yet added, the forward order of the groups (for implicit prefetch) and the
post-optimizer event. It also decides when a buffer that crossed streams may go ([Note:
memory that crosses streams]).

[Note: two ways to wait]
A collective is issued on a side stream and described by a ``Pending``: on an accelerator (and
with stand-in streams) the stream orders the collective, so it is issued blocking and an event
recorded after it says when it is done; on the CPU, gloo runs it on its own threads, so it is
issued with ``async_op=True`` and its work handle says when it is done. ``wait`` honours
whichever the ``Pending`` carries, and ``after`` queues work behind a collective either way: on
the collective's stream at once, or at the wait. The schedule is the same in both cases.

[Note: memory that crosses streams]
A buffer allocated on one stream and used by another must not be reused until the using
stream is done with it, or the caching allocator may hand it out again too early. We never
call ``record_stream``; every buffer goes at a fixed point of the schedule instead, one of
three kinds. A buffer that only the stream that allocated it used goes as soon as its last
use is queued (the packed gradients, on the reduce-scatter stream). A buffer another stream
read goes once its allocating stream has waited for that stream anyway (the unreduced
gradients, at the next group's post-backward, where the compute stream waits
for the reduction). Otherwise the allocating stream is made to wait on an event recorded
right after the last use, and then the buffer goes (the gathered buffers after their
copy-out, ``release_gathered``). The first two cost no wait of their own. The third orders
the copy-in stream's next work after the copy-out: in backward the next group's copy-in, as
torch's ``fully_shard`` orders it too; in forward only the copy-in one group later ([Note: in
forward, a gathered buffer goes one all-gather later]).

[Note: in forward, a gathered buffer goes one all-gather later]
A gathered buffer's last use is the copy out of it, on the copy-out stream; the copy-in
stream allocated it, so that stream waits for the copy-out before the buffer goes. Made at
once, that wait orders the next group's copy-in, and so its all-gather, after this group's
copy-out: the link idles through every copy-out. In forward (``hold_gathered``, set by the
root's hooks) each buffer is therefore released at the next group's copy-out instead, when
that group's copy-in is already queued: the copy-in two groups later waits for this copy-out,
long done, and the link goes from one all-gather straight to the next. One more gathered
buffer is alive in forward, as under torch's ``fully_shard``, which defers the same release
in forward (its all-gather state); the end of forward releases the last one. In backward,
where the unsharded gradients are alive too, each buffer goes at once. On the CPU the copy
runs at the wait and the buffer goes right after it.

[Note: in backward, a copy-in waits for the last reshard]
A copy-in waits for what the compute stream has queued when it is issued: the optimizer step
wrote the shards it reads, and the parameters' memory, which the copy-out stream will write,
may be memory the compute stream used and freed at a reshard. In backward nothing writes the
shards of a group still to be gathered (an optimizer stepped in backward steps groups whose
backward is done), so only the second reason holds, and only for what was freed: each
reshard on a device records an event right after it (``after_reshard``), and a copy-in of
backward waits for the latest one, not for all the compute queued. Waiting for the whole compute
stream, the first all-gather of backward had started only after the output layer and the loss
had run: in the plan of Llama 2 70B with 6 blocks on 64 A100s the link idled 46 ms there;
waiting for the last reshard, 35 ms. The first all-gather of backward waits for nothing (next
note). Shards written on the current stream since the last all-gather (``after_current``) are
waited for as before.

[Note: the first all-gather of backward is copied out where it is used]
The first all-gather of backward (the last block's, prefetched by the root's pre-backward) is
issued as backward starts and gathers a block that has just run its forward and been
resharded. Copied out on the copy-out stream, its parameters would take memory from that
stream's pool, where that very block's forward memory went back at its reshard, and so its
copy-in would have to wait for that forward (previous note). Instead, its copy-out is left to
the wait (``queue_copy_out(at_wait=True)``): the stream that computes the block's backward
waits for the all-gather, allocates the parameters and copies them out there, after the
reshard in its own order, so the copy-in waits for nothing and the all-gather goes out at once,
as torch's ``fully_shard`` lets its backward all-gathers go (its parameters are always the
compute stream's memory). Its gathered buffer then goes at the next copy-out, as a buffer of
forward does: released at once, it would order the next copy-in after this copy-out, that is
after the output layer and the loss. The cost is one block's copy-out on the compute stream
once a step. In the plan of Llama 2 70B with 6 blocks on 64 A100s (link-bound), the link's
idle time between forward's last all-gather and backward's first went from 35 ms to 8.5 ms
(torch's: 8.5 ms), and the step from 1077.2 ms to 1071.4 ms (torch's 1070.1 ms).

[Note: stream priorities]
The copy-in, all-gather, copy-out and reduce-scatter streams are created with priority -1,
above the compute stream's 0, as in torch's FSDP2: when the device has a free slot, the small
kernels that start a collective (the copy-in, the collective's own launch) go before the next
compute kernel, so the collective starts as early as the schedule allows instead of waiting
behind a long run of compute kernels. The HSDP all-reduce is not on the critical path of the
next layer and keeps the default priority.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from twinshard.guard import check_collective

from .streams import streams_for


@dataclass
class Pending:
    """A collective in flight; see [Note: two ways to wait]."""

    work: Any  # torch.distributed.Work, or None when a stream orders it (or once waited on)
    event: Any  # recorded after the collective on its stream (and what follows it), or None
    then: list = field(default_factory=list)  # ``CommContext.after``'s work, for the wait


@dataclass
class CommContext:
    device: torch.device
    forward_order: list = field(default_factory=list)  # groups, as the last forward started them
    backward_order: list = field(default_factory=list)  # reverse of the order they finished
    current_order: list = field(default_factory=list)  # being recorded by this forward
    current_post_order: list = field(default_factory=list)  # likewise, as they finish
    pending_reduce: list = field(default_factory=list)  # (ReduceScatterResult, hook) in flight
    post_optim_event: Any = None  # set_post_optim_event: the next all-gather waits on it
    copied_in: Any = None  # recorded on the copy-in stream right after the last copy-in
    hold_gathered: bool = False  # forward on a device: see [Note: in forward, a gathered ...]
    in_forward: bool = False  # from the first group's pre-forward to the root's post-forward
    in_backward: bool = False  # from the first pre-backward's own all-gather to backward's end
    resharded: Any = None  # recorded on the compute stream after the latest reshard
    first_gather_of_backward: bool = False  # set as backward starts, until its first all-gather
    freed_own: bool = False  # a reshard freed a parameter's own all-gather output since the
    # copy-in stream last waited for the reshards (see [Note: one parameter, no copy-out])
    held_gathered: Any = None  # (where, buffers, event) released at the next copy-out
    backends: dict = field(default_factory=dict)  # process group -> its backend's name

    def __post_init__(self):
        self.streams = streams_for(self.device)
        # issue collectives blocking where a stream orders them; see [Note: two ways to wait]
        self.async_op = not self.streams.collectives_follow_streams
        # see [Note: stream priorities]
        # builds the flat all-gather input while the previous group still computes
        self.copy_in_stream = self.streams.new_stream("copy_in", priority=-1)
        # runs all-gathers beside compute
        self.all_gather_stream = self.streams.new_stream("all_gather", priority=-1)
        # copies the parameters out of the gathered buffers, beside the next all-gather
        self.copy_out_stream = self.streams.new_stream("copy_out", priority=-1)
        # runs reduce-scatters beside the backward of earlier layers
        self.reduce_scatter_stream = self.streams.new_stream("reduce_scatter", priority=-1)
        # HSDP: runs the all-reduce across replicas after the reduce-scatter
        self.all_reduce_stream = self.streams.new_stream("all_reduce")

    # --- running and waiting ------------------------------------------------------------------
    def on(self, stream):
        """Context manager: the work inside it goes on ``stream``."""
        return self.streams.use(stream)

    def current_stream(self):
        return self.streams.current()

    def issue(self, collective, *args, stream, about=(), stands_for=None, **kwargs) -> Pending:
        """Run ``collective(*args, **kwargs)`` on ``stream`` and say how to wait for it.
        ``about``: the parameters it carries, named by the guard's checks in debug mode;
        ``stands_for``: the collective it amounts to, as those checks name it ("all_gather"
        for an exchange between two ranks), if not its own."""
        check_collective(stands_for or collective, args[-1], kwargs.get("group"), about)
        with self.on(stream):
            work = collective(*args, async_op=self.async_op, **kwargs)
            return Pending(work, stream.record_event())

    def runs_on_gloo(self, group) -> bool:
        """Whether ``group``'s backend is gloo, whose all-gather and reduce-scatter cost more
        than the exchanges they stand for; see [Note: all-gather on gloo] and [Note:
        reduce-scatter on gloo] in ``reduction.py``."""
        if group not in self.backends:
            self.backends[group] = dist.get_backend(group)
        return self.backends[group] == "gloo"

    def discard_pending(self) -> None:
        """After an aborted iteration: wait for the reductions in flight and drop them."""
        for result, _ in self.pending_reduce:
            self.wait(result.pending)
        self.pending_reduce = []

    def done_on(self, stream) -> Pending:
        """What was just queued on ``stream`` (no collective: a group of one rank)."""
        return Pending(None, stream.record_event())

    def after_reductions(self) -> None:
        """Order the current stream after the gradients made on the reduce-scatter stream, at
        the end of backward, before anything reads them (see [Note: the gradients are made on
        the reduce-scatter stream] in ``reduction.py``)."""
        self.current_stream().wait_stream(self.reduce_scatter_stream)

    def after_copy_in(self) -> None:
        """Order the current stream after the copy-in queued so far: an all-gather issued
        early read the shards there, and the next work on the current stream may write them
        (see [Note: a prefetch reads the shards when it is issued] in ``flat_group.py``)."""
        # on the CPU the copy-in is done already; on a device, the event right after it, not
        # the whole stream: releases queue waits for later copy-outs there
        if self.streams.collectives_follow_streams and self.copied_in is not None:
            self.current_stream().wait_event(self.copied_in)

    def after(self, pending: Pending, stream, work) -> None:
        """Run ``work()`` on ``stream`` once the collective ``pending`` is done: queued there
        now where a stream orders the collective (``pending`` then stands for both), at the
        wait where a work handle does; see [Note: two ways to wait]."""
        if pending.work is None:
            with self.on(stream):
                if pending.event is not None:
                    stream.wait_event(pending.event)
                work()
                pending.event = stream.record_event()
        else:
            pending.then.append(work)

    def wait(self, pending: Pending, stream=None) -> None:
        """Make ``stream`` (default: the current one) wait for ``pending``, and what
        ``after`` queued behind it."""
        if pending.work is not None:
            # Wait on a work handle once: gloo copies a reduce-scatter's result into its output
            # at every wait(), which would undo what was added to it since (HSDP partial sums).
            pending.work.wait()
            pending.work = None
            for work in pending.then:
                work()
            pending.then = []
        if pending.event is not None:
            (stream or self.current_stream()).wait_event(pending.event)

    # --- memory that crosses streams -------------------------------------------------------------
    def release_gathered(self, where: str, buffers: tuple, hold: bool = False) -> None:
        """Let a gathered buffer go, its copy-out just queued on the current stream: now, or
        on a device at the next copy-out, in forward and where ``hold`` says so; see [Note: in
        forward, a gathered buffer goes one all-gather later]."""
        held, self.held_gathered = self.held_gathered, None
        event = self.current_stream().record_event()
        if held is not None:
            self.release_held(held)
        if (self.hold_gathered or hold) and event is not None:
            self.held_gathered = (where, buffers, event)
        else:
            self.release_held((where, buffers, event))

    def release_held(self, held: tuple | None = None) -> None:
        """Release ``held`` (where, buffers, event), default the buffer held back for the next
        copy-out: the copy-in stream, which allocated it, waits for the event first."""
        if held is None:
            held, self.held_gathered = self.held_gathered, None
            if held is None:
                return
        where, buffers, event = held
        if event is not None:
            self.copy_in_stream.wait_event(event)
        self.streams.release(buffers, where)

    def start_forward(self) -> None:
        """A forward starts (the first group's pre-forward hook): the orders groups run in are
        recorded anew, and gathered buffers are held; see [Note: in forward, a gathered
        buffer goes one all-gather later]."""
        self.in_forward, self.in_backward = True, False
        self.current_order, self.current_post_order = [], []
        self.hold_gathered = not self.async_op

    def finish_forward(self) -> None:
        """The root's forward is over: the last gathered buffer of forward goes, and this
        forward's orders are those of the next step's prefetches."""
        self.in_forward = self.hold_gathered = False
        self.release_held()
        self.forward_order = self.current_order
        self.backward_order = self.current_post_order[::-1]

    def start_backward(self) -> None:
        """Backward has started: once, after the first pre-backward hook's own all-gather (the
        root's, which keeps its parameters after forward unless told otherwise) and before its
        prefetch; see [Note: the first all-gather of backward is copied out where ...]. A root
        without parameters of its own has no group to run it: then the first block's own
        all-gather still counts as forward's, and its copy-in waits for the current stream."""
        if not self.in_backward:
            self.in_backward = self.first_gather_of_backward = True

    def set_post_optim_event(self, event) -> None:
        """Let the next all-gather's copy-in wait on ``event`` (recorded after the optimizer
        step) rather than on everything the current stream has queued."""
        self.post_optim_event = event

    def before_all_gather(self, after_current: bool = False) -> bool:
        """Order the copy-in stream after the compute that produced the shards: after all that
        the current stream has queued, or, when ``set_post_optim_event`` gave an event, only
        after that event; in backward only after the last reshard, and the first all-gather
        of backward after nothing. ``after_current``: the current stream wrote shards after
        the event (the group moved blocks into its storage, or the user gave parameters new
        memory), so the copy-in waits for it as well. Returns whether the copy-out is left to
        the wait, on the stream that uses the parameters."""
        event, self.post_optim_event = self.post_optim_event, None
        first, self.first_gather_of_backward = self.first_gather_of_backward, False
        if event is not None:
            self.copy_in_stream.wait_event(event)
        if after_current or (event is None and not self.in_backward):
            self.copy_in_stream.wait_stream(self.current_stream())
            self.freed_own = False
        elif event is None and first and not self.freed_own:
            return True  # see [Note: the first all-gather of backward is copied out where ...]
        elif event is None and self.resharded is not None:
            # see [Note: in backward, a copy-in waits for the last reshard]
            self.copy_in_stream.wait_event(self.resharded)
            self.freed_own = False
        return False

    def after_reshard(self, own: bool = False) -> None:
        """Note where the current stream freed unsharded parameters; see [Note: in backward, a
        copy-in waits for the last reshard]. ``own``: they were a parameter's own all-gather
        output, memory of the copy-in stream ([Note: one parameter, no copy-out] in
        ``collectives.py``). Nothing to note where streams do nothing."""
        if not self.async_op:
            self.resharded = self.current_stream().record_event()
            self.freed_own = self.freed_own or own
