"""The memory half of the cost contract: when a group may, and when it must, hold memory.

After every hook of a recorded micro-batch, ``twinshard.measure.schedule.Recorder`` notes the state of
each group's parameters (U unsharded, S sharded, P a post-forward piece) and the bytes alive in
unsharded parameters (all-gather outputs still in flight included) and in unsharded gradients
(reduce-scatter inputs still alive included), measured on the implementation's own tensors.
The contract turns the setting into windows of hooks, per group:

- **parameters** may be unsharded from the hook that may prefetch the group (the pre-hook of
  the group that runs just before it in this pass, or of a module whose explicit prefetch
  list names it; else its own pre-hook) up to the hook that must free them: its post-forward
  when ``reshard_after_forward`` is True or an int (an int keeps only a 1/N piece, which is no
  unsharded memory), its post-backward (the end of backward for a group whose inputs need no
  gradient) otherwise, and not at all after that unless ``set_reshard_after_backward(False)``
  keeps them for the next micro-batch. A group that is kept (the root by default,
  ``reshard_after_forward=False``, ``set_reshard_after_backward(False)``) must be unsharded
  there, and every group must be right after its own pre-hooks.
- **gradients** may be alive from the group's pre-backward up to the post-backward hook that
  follows its own (one reduction in flight while the next group computes), to the end of the
  micro-batch where gradient sync is off (they wait for a later one), and into the next
  micro-batches until they are reduced. One rank's block of the reduced sums (in
  ``reduce_dtype``, the size of a shard, not unsharded memory) may live until the end of
  backward: torch's ``fully_shard`` keeps each group's until its final callback when
  ``reduce_dtype`` differs from the parameters' dtype on HSDP.

The bytes allowed after a hook are the sum, over the groups whose window covers it, of the
group padded to the shard group (in ``param_dtype`` for parameters, in the larger of
``param_dtype`` and ``reduce_dtype`` for gradients, whose unsharded copy may be cast for the
reduction), plus one rank's block of the reduced sums (in ``reduce_dtype``) where that may
live, and for an HSDP group whose all-reduce waits (``set_requires_all_reduce(False)``). With the
default prefetch of one group the bound is the root, the group computing and the one
prefetched; ``reshard_after_forward=False`` keeps them all. The bytes are measured on the
recorded step, as the memory predictor (``twinshard.measure.memory``) measures them on the fake
accelerator; the windows are the setting's, not a recording's, so that a step holding more
than its setting allows fails here.
"""

from __future__ import annotations

from .compare import Checker
from .contract import GroupStep, Plan
from .contract_check import name


def _index(events, hook: str, path: str, last: bool = False) -> int | None:
    found = [e.index for e in events if e.hook == hook and e.group == path]
    return (found[-1] if last else found[0]) if found else None


def _order(events, hook: str) -> list[str]:
    seen: list[str] = []
    for e in events:
        if e.hook == hook and e.group not in seen:
            seen.append(e.group)
    return seen


class Windows:
    """Per group, the hooks (event indices) after which it may hold unsharded parameters,
    must hold them, and may hold gradients or waiting partial sums; and per pass, the first
    and the last hook that may issue its all-gather."""

    def __init__(self, plan: Plan, steps: dict[str, GroupStep], events: list):
        self.plan, self.events, self.steps = plan, events, steps
        n = len(events)
        finals = [e.index for e in events if e.hook == "final_callback"]
        self.final = finals[-1] if finals else n - 1
        self.orders = {"forward": _order(events, "pre_forward")}
        self.orders["backward"] = _order(events, "pre_backward")
        self.may: dict[str, set[int]] = {}
        self.lag: dict[str, set[int]] = {}
        self.must: dict[str, set[int]] = {}
        self.grads: dict[str, set[int]] = {}
        self.partial: dict[str, set[int]] = {}
        self.reduced: dict[str, set[int]] = {}  # its reduced block, until the end of backward
        self.issue: dict[tuple[str, str], tuple[int, int]] = {}  # (group, pass) -> first, last
        for g in plan.groups:
            for kind in (self.may, self.lag, self.must, self.grads, self.partial, self.reduced):
                kind[g.path] = set()
            self._params(g.path, steps[g.path], n)
            self._grads(g.path, steps[g.path], n)

    def _first_of(self, phase: str, path: str) -> int | None:
        """The earliest hook that may issue ``path``'s all-gather in this pass: its own
        pre-hook, that of the group before it (implicit prefetch), or that of a module whose
        explicit list names it. In backward a group kept from forward gathers nothing, so the
        group before it counts too: the pre-backward hooks of a root and of a piece of it
        ([Note: the root's parameters in pieces]) both hang on the model's output, in either
        order. In backward a piece may be gathered as early as the group it was cut from,
        which needs it at once ([Note: the first block in two pieces])."""
        hook = "pre_" + phase
        own = _index(self.events, hook, path)
        if own is None:
            return None
        order = self.orders[phase]
        lists = self.plan.forward_prefetch if phase == "forward" else self.plan.backward_prefetch
        candidates = [own] + [_index(self.events, hook, h) for h, n in lists.items() if path in n]
        before = order[: order.index(path)] if path in order else []
        while before:  # the group before it; in backward, past groups that gather nothing
            previous = before.pop()
            candidates.append(_index(self.events, hook, previous))
            step = self.steps.get(previous)
            if phase == "forward" or step is None or step.gather_backward is not None:
                break
        parent = self.plan.group(path).cut_from
        if phase == "backward" and parent is not None:
            candidates.append(self._first_of(phase, parent))
        first = min(c for c in candidates if c is not None)
        self.issue[path, phase] = (first, own)
        return first

    def _params(self, path: str, st: GroupStep, n: int) -> None:
        ev, may, must = self.events, self.may[path], self.must[path]
        pf, qf = _index(ev, "pre_forward", path), _index(ev, "post_forward", path, last=True)
        pb, qb = _index(ev, "pre_backward", path), _index(ev, "post_backward", path, last=True)
        if pf is None or qf is None:
            return  # it did not run: nothing to hold
        end = qb if qb is not None else self.final  # where its backward ends
        start = self._first_of("forward", path)
        if st.starts_unsharded:
            start = 0
            must.update(range(0, pf + 1))
        close = n if st.ends_unsharded else end  # exclusive
        must.add(pf)
        # the all-gather output may outlive its copy-out until the next group's copy-out
        later = [e.index for e in ev if e.hook == "pre_forward" and e.index > qf]
        forward_end = max(e.index for e in ev if e.hook == "post_forward")
        self.lag[path].update(range(pf, later[0] if later else forward_end))
        if st.after_forward == "unsharded":
            may.update(range(start, close))
            must.update(range(qf, (pb if pb is not None else end) + 1))
        else:
            may.update(range(start, qf))
            if st.gather_backward is not None and pb is not None:
                may.update(range(self._first_of("backward", path), close))
                must.add(pb)
        if st.ends_unsharded:
            must.update(range(end, n))

    def _grads(self, path: str, st: GroupStep, n: int) -> None:
        ev = self.events
        pb, qb = _index(ev, "pre_backward", path), _index(ev, "post_backward", path, last=True)
        end = qb if qb is not None else self.final
        if pb is not None:
            later = [e.index for e in ev if e.hook == "post_backward" and e.index > end]
            until = (later[0] if later else self.final) if st.reduce else n
            self.grads[path].update(range(0 if st.carries_grads else pb, until))
            # a block apart from the sharded gradient: across replicas, or in another dtype
            g = self.plan.group(path)
            apart = self.plan.replicas > 1 or self.plan.grad_dtype(g) != g.dtypes[0]
            if st.reduce and apart:  # the size of a shard: may stay until the end of backward
                self.reduced[path].update(range(pb, self.final))
        if st.partial_sums:
            self.partial[path].update(range(0, n if not st.all_reduce else end + 1))
        if st.reduce and not st.all_reduce and self.plan.replicas > 1:
            self.partial[path].update(range(end, n))

    # --- bytes allowed -------------------------------------------------------------------------
    def param_bytes(self, i: int) -> tuple[int, list[str]]:
        plan, allowed, names = self.plan, 0, []
        for g in plan.groups:
            size = g.padded(plan.shard) * plan.gather_dtype(g).itemsize
            if i in self.may[g.path]:
                allowed, names = allowed + size, names + [name(g.path)]
            if i in self.lag[g.path]:
                allowed, names = allowed + size, names + [f"{name(g.path)}'s all-gather output"]
        return allowed, names

    def grad_bytes(self, i: int) -> tuple[int, list[str]]:
        plan, S = self.plan, self.plan.shard
        allowed, names = 0, []
        for g in plan.groups:
            size = max(plan.gather_dtype(g).itemsize, plan.grad_dtype(g).itemsize)
            if i in self.grads[g.path]:
                allowed += g.padded(S) * size
                names.append(name(g.path))
            if i in self.reduced[g.path]:  # one rank's block of the sums, in reduce_dtype
                allowed += g.padded(S) // S * plan.grad_dtype(g).itemsize
                names.append(f"{name(g.path)} (reduced block)")
            if i in self.partial[g.path]:
                allowed += g.padded(S) // S * plan.grad_dtype(g).itemsize
                names.append(f"{name(g.path)} (partial sums)")
        return allowed, names


def check_memory(checker: Checker, plan: Plan, where: str, steps, schedule, seen) -> dict:
    """One micro-batch: where each all-gather was issued, and the bytes and states after every
    hook, against the windows. ``seen``: its collectives (``contract_check.seen_collectives``).
    Returns the peaks seen ({'unsharded': bytes, 'grads': bytes}) for the report."""
    w = Windows(plan, steps, schedule.events)
    failed: set = set()
    events = schedule.events

    def once(key, message):  # the first violation of each kind is enough to read
        checker.count += 1
        if key not in failed:
            failed.add(key)
            checker.fail(message)

    for c in seen:
        window = w.issue.get((c.group, c.phase))
        if c.op != "all_gather" or c.event is None or window is None:
            continue  # a gather the contract has no place for fails in check_collectives
        first, last = window
        checker.count += 1
        if not first <= c.event <= last:
            at, earliest = events[c.event], events[first]
            once(
                ("issued", c.group),
                f"{where}: the {c.phase} all-gather of {name(c.group)} was issued in "
                f"{at.hook} of {name(at.group)}; the earliest hook that may issue it is "
                f"{earliest.hook} of {name(earliest.group)} (prefetch: the group before it "
                "in this pass or a module whose list names it), the latest its own",
            )

    for e in schedule.events:
        after = f"{where}, after {e.hook} of {name(e.group)}"
        allowed, inside = w.param_bytes(e.index)
        if e.unsharded_bytes > allowed:
            once(
                ("params",),
                f"{after}: {e.unsharded_bytes} bytes of unsharded parameters, the contract "
                f"allows {allowed} ({', '.join(inside) or 'no group'})",
            )
        allowed, inside = w.grad_bytes(e.index)
        if e.grad_bytes > allowed:
            once(
                ("grads",),
                f"{after}: {e.grad_bytes} bytes of unsharded gradients, the contract allows "
                f"{allowed} ({', '.join(inside) or 'none'})",
            )
        for g in plan.groups:
            letters = set(e.states.get(g.path, {}).values())
            if "U" in letters and e.index not in w.may[g.path]:
                once(("free", g.path), f"{after}: {name(g.path)} is unsharded; it must be freed")
            if e.index in w.must[g.path] and letters != {"U"}:
                once(
                    ("kept", g.path),
                    f"{after}: {name(g.path)} is {''.join(sorted(letters))}; the setting "
                    "keeps it unsharded here",
                )
    return {
        "unsharded": max((e.unsharded_bytes for e in events), default=0),
        "grads": max((e.grad_bytes for e in events), default=0),
    }
