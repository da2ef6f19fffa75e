"""The hooks of the optimized implementation: the reference's, plus prefetching.

[Note: implicit prefetch]
While group g computes, the all-gather of the group that runs next is already on the wire.
In forward, "next" is the group after g in the order the previous forward started them
(``CommContext.forward_order``; the first step has no order yet and does not prefetch). In
backward it is the group after g in the reverse of the order the previous forward *finished*
them (``backward_order``): the root starts forward first but finishes last, so in backward it
comes first and prefetches the last block. ``set_modules_to_forward_prefetch`` /
``set_modules_to_backward_prefetch`` replace the implicit choice. Prefetching only decides
*when* an all-gather is issued: a group always waits for its own all-gather before it
computes, so a wrong guess costs memory and time, never correctness. Every rank derives the
same order from the same model, so the collectives stay matched across ranks. One group
ahead keeps at most two groups' unsharded parameters in flight (plus the root's).
What an early all-gather reads: the group's sharded parameters as they are when it is issued.
An edit of them made after that and before the group's own pre-forward (a pre-hook registered
with ``prepend=True``, the parent's forward) is seen from the group's next all-gather on, not
by this forward; torch's explicit prefetch lists behave the same way, its default does not
prefetch in forward (docs/concepts.md, the conformance case ``edit_between_forwards``).

[Note: in forward, the next all-gather goes out before the copy-out]
A block's pre-forward issues the next group's all-gather before it waits for its own, so the
link goes from one all-gather straight to the next instead of idling through the wait and the
copy-in. On the CPU, where the copy-out runs at the wait, that keeps two all-gather outputs
alive during the copy-out, one more group's worth than backward, which waits first: backward
holds the unsharded gradients of at least one group on top, so with groups of equal size the
step's peak does not grow. (On a device the copy-out follows each all-gather on a stream of
its own; [Note: the copy-out on a stream of its own] in ``collectives.py``.) The root's
pre-forward does the same in another order: the reference's pre-forward, which starts the
step's count (the guard names collectives by it), issues the root's all-gather
(``wait_in_unshard`` off), then the next group's goes out and only then does the root wait
for its own. Waiting first, the root's copy-out stood between the two all-gathers: 1.3 ms of
link idle a step in the plan of Llama 2 70B with 6 blocks on 64 A100s, which made that plan
1.3 ms slower than torch's.
"""

from __future__ import annotations

import torch

from twinshard.reference.param_group import TrainingState
from twinshard.reference.state import FSDPState as ReferenceState
from twinshard.reference.state import get_state

from .comm import CommContext
from .flat_group import FlatParamGroup, finish_reduce


def unguarded(hook):
    """A reference hook without its ``torch.compiler.disable`` guard (the function that
    ``functools.wraps`` keeps as ``__wrapped__``). The hooks below carry the guard themselves,
    and entering it a second time costs about 5,000 instructions per hook call."""
    return getattr(hook, "__wrapped__", hook)


REFERENCE_PRE_FORWARD = unguarded(ReferenceState.pre_forward)
REFERENCE_POST_FORWARD = unguarded(ReferenceState.post_forward)
REFERENCE_PRE_BACKWARD = unguarded(ReferenceState.pre_backward)


class FSDPState(ReferenceState):
    """Reference hooks (``twinshard.reference.state.FSDPState``) with prefetch and a shared
    communication context."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.forward_hint: list | None = None  # explicit set_modules_to_forward_prefetch
        self.backward_hint: list | None = None
        self.comm: CommContext | None = None
        self.prefetched = False  # a forward prefetch whose copy-in the hook has not ordered

    def lazy_init(self) -> None:
        if self.is_root is not None:
            return
        super().lazy_init()
        device = next(
            (s.group.device for s in self.all_states if s.group is not None), torch.device("cpu")
        )
        self.comm = self.comm or CommContext(device)  # set already by share_comm_ctx
        for state in self.all_states:
            state.use_comm(self.comm)

    def use_comm(self, comm: CommContext) -> None:
        """Share the root's ``comm`` (streams, work in flight) with this module's group."""
        self.comm = comm
        if self.group is not None:
            self.group.use_comm(comm)

    # --- forward ----------------------------------------------------------------------------
    @torch.compiler.disable
    def pre_forward(self, module, args, kwargs):
        self.lazy_init()
        recompute = self.group is not None and self.group.state is TrainingState.PRE_BACKWARD
        if self.is_root and not recompute:
            self.comm.current_order, self.comm.current_post_order = [], []
            self.comm.in_backward = False
            # see [Note: in forward, a gathered buffer goes one all-gather later] in comm.py
            self.comm.hold_gathered = not self.comm.async_op
        # see [Note: in forward, the next all-gather goes out before the copy-out]
        early = self.group is not None and not recompute
        if early and not self.is_root:
            self.group.unshard_async()  # this group's own all-gather, unless prefetched
            self.prefetch(self.forward_hint, self.comm.forward_order)
        elif early:  # the reference's pre-forward starts the step, then issues the gather
            self.group.wait_in_unshard = False
        try:
            args, kwargs = REFERENCE_PRE_FORWARD(self, module, args, kwargs)
        finally:
            if self.group is not None:
                self.group.wait_in_unshard = True
        if self.group is not None and self.group.state is TrainingState.FORWARD:
            if self.group not in self.comm.current_order:
                self.comm.current_order.append(self.group)  # the order groups start forward
            if not early or self.is_root:
                self.prefetch(self.forward_hint, self.comm.forward_order)
        if early and self.is_root:
            self.group.wait_for_unshard()
        if self.prefetched and (self.is_root or not early):  # the parent's code runs next
            self.order_prefetch()
        return args, kwargs

    def order_prefetch(self) -> None:
        """Order the current stream after the copy-in of the forward prefetch this hook
        issued; see [Note: a prefetch reads the shards when it is issued] in
        ``flat_group.py``."""
        self.comm.after_copy_in()
        self.prefetched = False

    @torch.compiler.disable
    def post_forward(self, module, args, output):
        if self.group is not None and self.group.state is TrainingState.FORWARD:
            finished = self.comm.current_post_order
            if self.group not in finished:
                finished.append(self.group)  # the order groups finish forward
        if self.prefetched:  # the next group's pre-hooks and the parent's code run next
            self.order_prefetch()
        output = REFERENCE_POST_FORWARD(self, module, args, output)
        if self.is_root:
            self.comm.hold_gathered = False
            self.comm.release_held()  # the last gathered buffer of forward
            self.comm.forward_order = self.comm.current_order
            self.comm.backward_order = self.comm.current_post_order[::-1]
            for state in self.all_states:  # a prefetch nobody used must not linger
                group = state.group
                if group is not None and group.in_flight is not None and group is not self.group:
                    group.reshard()
        return output

    # --- backward ---------------------------------------------------------------------------
    @torch.compiler.disable
    def pre_backward(self, grad: torch.Tensor) -> None:
        REFERENCE_PRE_BACKWARD(self, grad)
        # see [Note: in backward, a copy-in waits for the last reshard] in comm.py
        if not self.comm.in_backward:
            self.comm.in_backward = self.comm.first_gather_of_backward = True
        if self.group is not None:
            self.prefetch(self.backward_hint, self.comm.backward_order, backward=True)

    def reset(self) -> None:
        super().reset()
        if self.is_root and self.comm is not None:
            self.comm.discard_pending()  # the failed iteration's reductions are dropped
            self.comm.hold_gathered = self.comm.in_backward = False
            self.comm.release_held()

    def finish_groups(self) -> list:
        """The reference's end of backward for every group, between the additions of the
        reductions still in flight: the last group's before, and after, those of groups whose
        post-backward ran only just now. The root's final callback then waits for offloaded
        gradients and tallies which parameters were used."""
        finish_reduce(self.comm)
        groups = super().finish_groups()
        finish_reduce(self.comm)
        self.comm.after_reductions()
        self.comm.in_backward = False
        self.comm.release_held()  # the first gather of backward's, where no other followed
        return groups

    # --- prefetch ---------------------------------------------------------------------------
    def prefetch(self, hint: list | None, order: list, backward: bool = False) -> None:
        """Issue the all-gathers of the groups that run next; see [Note: implicit prefetch].
        Sets ``prefetched`` where one was issued in forward, whose copy-in the forward hook
        orders the current stream after, at its end (see [Note: a prefetch reads the shards
        when it is issued] in ``flat_group.py``)."""
        for group in self.prefetch_targets(hint, order):
            if backward and not group.unshard_in_backward:
                continue  # set_unshard_in_backward(False): backward does not need them
            if isinstance(group, FlatParamGroup) and group is not self.group:
                issued = group.prefetch(order_now=False)
                self.prefetched = self.prefetched or (issued and not backward)

    def prefetch_targets(self, hint: list | None, order: list) -> list:
        """The groups to all-gather now, while this one computes: the modules of ``hint`` (an
        explicit prefetch list), else the group right after this one in ``order`` (the order
        in which groups run in this pass). A variant with another policy overrides this."""
        if hint is not None:
            return [s.group for m in hint if (s := get_state(m)) is not None and s.group]
        if self.group not in order:
            return []
        i = order.index(self.group)
        return order[i + 1 : i + 2]
