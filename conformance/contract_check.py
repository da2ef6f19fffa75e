"""Check recorded micro-batches against the cost contract's collectives (``contract.py``).

Each micro-batch is one ``twinshard.measure.schedule.Schedule``: the hooks the implementation ran and
the collectives it issued, each attributed to the hook during which it was issued and to the
group whose parameters or gradients it carries. Per micro-batch and pass (forward, backward)
the contract compares

- per kind of collective: the elements in all, their dtype and the size of the process group
  against what the groups due for it need, and the number of collectives against one per group
  or one per parameter (an implementation may batch either way, not otherwise);
- per group, the elements all-gathered (a group gathered twice, or the wrong one, shows here);
- that nothing else was issued: no other kind of collective, none over a group of one rank,
  none after the step's last hook.

On gloo without replicas an implementation may all-reduce its gradients in place instead of
reduce-scattering them (gloo's reduce-scatter is an all-reduce of a copy), so there a
floating-point all-reduce over the shard group counts as the reduce-scatter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .compare import Checker
from .contract import GroupStep, Plan

OPS = ("all_gather", "reduce_scatter", "all_reduce")
PHASES = ("forward", "backward")


@dataclass(frozen=True)
class Seen:
    """A recorded collective as the contract reads it."""

    op: str
    phase: str  # forward | backward | after (issued after the micro-batch's last hook)
    group: str | None  # the group it carries (None: none could be found)
    dtype: torch.dtype
    numel: int
    ranks: int
    event: int | None  # the hook it was issued in


@dataclass(frozen=True)
class Due:
    """A collective the contract asks for."""

    op: str
    phase: str
    group: str
    dtype: torch.dtype
    numel: int
    ranks: int
    n_params: int


def seen_collectives(plan: Plan, schedule) -> list[Seen]:
    """The schedule's collectives; see the module docstring for gloo's all-reduce."""
    out = []
    for c in schedule.collectives:
        dtype = getattr(torch, c.dtype)
        numel = c.nbytes // max(dtype.itemsize, 1)
        op = c.op
        stand_in = op == "all_reduce" and dtype.is_floating_point and plan.replicas == 1
        if stand_in and c.ranks == plan.shard > 1:
            op = "reduce_scatter"
        phase = "after" if c.event is None else schedule.events[c.event].phase
        out.append(Seen(op, phase, c.group, dtype, numel, c.ranks, c.event))
    return out


def due_collectives(plan: Plan, steps: dict[str, GroupStep]) -> list[Due]:
    """What one micro-batch must issue, group by group."""
    S, R = plan.shard, plan.replicas
    out = []
    for g in plan.groups:
        st = steps[g.path]
        padded, gather, grad = g.padded(S), plan.gather_dtype(g), plan.grad_dtype(g)
        for phase, ranks in (("forward", st.gather_forward), ("backward", st.gather_backward)):
            if ranks is not None and S > 1:
                out.append(Due("all_gather", phase, g.path, gather, padded, ranks, g.n_params))
        if st.reduce and S > 1:
            out.append(Due("reduce_scatter", "backward", g.path, grad, padded, S, g.n_params))
        if st.all_reduce:
            out.append(Due("all_reduce", "backward", g.path, grad, padded // S, R, g.n_params))
    return out


def name(path: str | None) -> str:
    return "root" if path == "" else (path or "no group")


def _amount(items) -> str:
    items = list(items)
    if not items:
        return "none"
    dtypes = sorted({str(i.dtype).removeprefix("torch.") for i in items})
    ranks = sorted({i.ranks for i in items})
    return (
        f"{len(items)} collective(s), {sum(i.numel for i in items)} elements in "
        f"{'/'.join(dtypes)} over {'/'.join(map(str, ranks))} ranks"
    )


def _stray(s: Seen) -> str | None:
    """Why the contract has no place for ``s`` at all, or None."""
    if s.op not in OPS or not s.dtype.is_floating_point:
        return "of a kind the contract has not (parameters and gradients only)"
    if s.phase == "after":
        return "issued after the last hook"
    if s.ranks == 1:
        return "over a process group of one rank, which has nothing to exchange"
    return None


def check_collectives(checker: Checker, plan: Plan, where: str, due: list[Due], seen: list[Seen]):
    """One micro-batch: the amounts per pass and kind, per group, and nothing else."""
    strays: dict[str, list[Seen]] = {}
    for s in seen:
        checker.count += 1
        if (why := _stray(s)) is not None:
            strays.setdefault(why, []).append(s)
    for why, items in strays.items():
        kinds = sorted({f"{i.op} ({name(i.group)}, {i.phase})" for i in items})
        checker.fail(f"{where}: {len(items)} collective(s) {why}: {', '.join(kinds)}")
    for phase in PHASES:
        for op in OPS:
            mine = [s for s in seen if s.op == op and s.phase == phase and s.ranks > 1]
            owed = [d for d in due if d.op == op and d.phase == phase]
            checker.count += 1
            _compare(checker, f"{where}, {phase}, {op}", mine, owed)
    for d_phase in PHASES:
        owed = {d.group: d.numel for d in due if d.op == "all_gather" and d.phase == d_phase}
        got: dict[str | None, int] = {}
        for s in seen:
            if s.op == "all_gather" and s.phase == d_phase and s.ranks > 1:
                got[s.group] = got.get(s.group, 0) + s.numel
        for path in sorted(set(owed) | set(got), key=lambda p: (p is None, p or "")):
            checker.count += 1
            if owed.get(path, 0) != got.get(path, 0):
                checker.fail(
                    f"{where}, {d_phase}: {name(path)} all-gathered {got.get(path, 0)} elements, "
                    f"the contract asks for {owed.get(path, 0)}"
                    + ("" if path is not None else " (these carry no group's parameters)")
                )


def _compare(checker: Checker, where: str, mine: list[Seen], owed: list[Due]) -> None:
    total, need = sum(s.numel for s in mine), sum(d.numel for d in owed)
    groups = ", ".join(name(d.group) for d in owed) or "no group is due one here"
    if total != need or (mine and not owed):
        checker.fail(f"{where}: {_amount(mine)}; the contract asks for {_amount(owed)} ({groups})")
        return
    if not owed:
        return
    dtypes, ranks = {d.dtype for d in owed}, {d.ranks for d in owed}
    if {s.dtype for s in mine} != dtypes or {s.ranks for s in mine} != ranks:
        checker.fail(f"{where}: {_amount(mine)}; the contract asks for {_amount(owed)}")
    counts = {len(owed), sum(d.n_params for d in owed)}
    if len(mine) not in counts:
        checker.fail(
            f"{where}: {len(mine)} collectives, where one per group ({len(owed)}) or one per "
            f"parameter ({sum(d.n_params for d in owed)}) carries them"
        )


def counts(seen: list[Seen]) -> str:
    """'AG 4 (1.2k) / RS 4 (1.2k) / AR 0' for a report."""
    parts = []
    for op, short in zip(OPS, ("AG", "RS", "AR")):
        mine = [s for s in seen if s.op == op]
        size = sum(s.numel * s.dtype.itemsize for s in mine)
        parts.append(f"{short} {len(mine)}" + (f" ({size / 1024:.1f} KiB)" if mine else ""))
    others = [s for s in seen if s.op not in OPS]
    if others:
        parts.append(f"other {len(others)}")
    return " / ".join(parts)
