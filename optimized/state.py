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
with ``prepend=True``, the parent's forward) is seen by this forward as under torch's default,
which gathers at the group's own pre-forward: the group is gathered again there ([Note: an
edit after an implicit prefetch] in ``flat_group.py``). Under an explicit prefetch list,
torch's and ours, the edit is seen from the group's next all-gather on (docs/optimized-path.md,
the conformance case ``edit_between_forwards``).

[Note: in forward, the next all-gather goes out before the copy-out]
A block's pre-forward issues the next group's all-gather before it waits for its own, so the
link goes from one all-gather straight to the next instead of idling through the wait and the
copy-in. On the CPU, where the copy-out runs at the wait, that keeps two all-gather outputs
alive during the copy-out, one more group's worth than backward, which waits first: backward
holds the unsharded gradients of at least one group on top, so with groups of equal size the
step's peak does not grow. (On a device the copy-out follows each all-gather on a stream of
its own; [Note: the copy-out on a stream of its own] in ``collectives.py``.) The root's
pre-forward does the same: its own all-gather, then the next group's, then the wait for its
own. Waiting first, the root's copy-out stood between the two all-gathers: 1.3 ms of link idle
a step in the plan of Llama 2 70B with 6 blocks on 64 A100s, which made that plan 1.3 ms
slower than torch's. The reference decides when this happens and the optimized path how,
through the contract's one seam for "issue now, wait later": the reference's hooks hand
``while_gathering`` to ``ParamGroup.unshard``, which the reference runs after its blocking
all-gathers and ``FlatParamGroup.unshard`` runs between issuing and waiting (in backward after
the wait, as above).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from twinshard.api import MixedPrecisionPolicy
from twinshard.reference.param_group import ParamGroup, TrainingState
from twinshard.reference.state import FSDPState as ReferenceState
from twinshard.reference.state import get_state

from .comm import CommContext
from .flat_group import FlatParamGroup, finish_reduce


class FSDPState(ReferenceState):
    """Reference hooks (``twinshard.reference.state.FSDPState``) with prefetch and a shared
    communication context."""

    def __init__(
        self,
        modules: list[nn.Module],
        group: ParamGroup | None,
        mp: MixedPrecisionPolicy,
        auto_reshard_after_forward: bool,
    ):
        super().__init__(modules, group, mp, auto_reshard_after_forward)
        self.forward_hint: list | None = None  # explicit set_modules_to_forward_prefetch
        self.backward_hint: list | None = None
        self.comm: CommContext | None = None
        self.pieces: list[FSDPState] = []  # see [Note: the root's parameters in pieces]

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
        if isinstance(self.group, FlatParamGroup):
            self.group.root_group = True  # its prefetch is ordered as soon as it has waited
        for piece in self.pieces:  # kept from forward to backward, as the root's own group
            if piece.auto_reshard_after_forward and piece.group is not None:
                piece.group.post_forward_info = None

    def use_comm(self, comm: CommContext) -> None:
        """Share the root's ``comm`` (streams, work in flight) with this module's group."""
        self.comm = comm
        if self.group is not None:
            self.group.use_comm(comm)

    # --- the seam: what runs while this group's all-gather is in flight -----------------------
    def while_gathering(self) -> None:
        """Issue the all-gathers of the groups that run next (``ParamGroup.unshard``'s
        ``meanwhile``), and note the order groups start forward in."""
        if self.group.state is TrainingState.FORWARD:
            if self.group not in self.comm.current_order:
                self.comm.current_order.append(self.group)  # the order groups start forward
            self.prefetch(self.forward_hint, self.comm.forward_order)
        else:  # after the first pre-backward's own all-gather, as [Note: the first ...]
            self.comm.start_backward()
            self.prefetch(self.backward_hint, self.comm.backward_order, backward=True)

    # --- the ends of forward and backward, and an aborted iteration ---------------------------
    def finish_forward(self) -> None:
        """The reference's end of forward (the root's), then the order of this forward is
        kept for the next step's prefetches, and a prefetch nobody used is freed."""
        super().finish_forward()
        self.comm.finish_forward()  # the last gathered buffer of forward goes too
        for state in self.all_states:  # a prefetch nobody used must not linger
            group = state.group
            if group is not None and group.in_flight is not None and group is not self.group:
                group.reshard()

    def reset(self) -> None:
        super().reset()
        if self.is_root and self.comm is not None:
            self.comm.discard_pending()  # the failed iteration's reductions are dropped
            self.comm.hold_gathered = self.comm.in_backward = self.comm.in_forward = False
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
        Marks this group ``prefetched`` where one was issued in forward, whose copy-in the
        current stream is ordered after later (see [Note: a prefetch reads the shards when it
        is issued] in ``flat_group.py``)."""
        targets = self.prefetch_targets(hint, order)
        if backward or hint is not None:  # a group's pieces with it: [Note: the first block ...]
            targets = [g for t in targets for g in (t, *getattr(t, "pieces", ()))]
        for group in targets:
            if backward and not group.unshard_in_backward:
                continue  # set_unshard_in_backward(False): backward does not need them
            if isinstance(group, FlatParamGroup) and group is not self.group:
                issued = group.prefetch(order_now=False)
                self.group.prefetched = self.group.prefetched or (issued and not backward)
                if issued and not backward and hint is None:
                    group.watch_for_edits()  # [Note: an edit after an implicit prefetch]

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
