"""The cost contract: what a setting obliges an FSDP implementation to communicate and keep.

Gradients that come out right can still cost too much: a gradient accumulation that reduces
on every micro-batch, an all-gather in fp32 that is cast to bf16 afterwards, a group gathered
again in backward although ``reshard_after_forward=False`` kept it, all-gathers prefetched for
every group at once. None of these changes a value. The contract states, per micro-batch and
per parameter group, what must and what must not happen, from the setting alone:

- **collectives** (``expected``): a group is all-gathered in forward unless it is still
  unsharded from the micro-batch before (``set_reshard_after_backward(False)``), and again in
  backward unless it was kept (``reshard_after_forward=False``, the root by default) or
  ``set_unshard_in_backward(False)`` says backward needs no weights; an int
  ``reshard_after_forward=N`` gathers the backward's copy over N ranks from the kept pieces.
  Its gradients are reduce-scattered over the shard group on a micro-batch with gradient sync,
  and all-reduced over the replicas (HSDP) only where ``set_requires_all_reduce`` allows; a
  shard group of one rank needs no all-gather and no reduce-scatter, a single replica no
  all-reduce. All-gathers carry the padded group in ``param_dtype``, reductions run in
  ``reduce_dtype``.
- **memory** (``windows``, in ``contract_memory.py``): when a group may hold unsharded
  parameters: from the hook that may prefetch it (the group that runs just before it in this
  pass, or a module whose explicit prefetch list names it) up to the hook that must free it.

A ``Plan`` describes the setting: the groups (their parameters' shapes and
``reshard_after_forward``), the mesh, the dtypes, and per micro-batch what the case switched
on or off. ``expected`` turns it into ``GroupStep`` s, one per micro-batch and group.
``contract_check.py`` compares them with what ``twinshard.measure.schedule.Recorder`` saw.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn


@dataclass
class GroupSpec:
    """One ``fully_shard`` call: the module's path ("" for the root) and its parameters."""

    path: str
    shapes: list[torch.Size]  # its trainable parameters, in the unsharded model
    dtypes: list[torch.dtype]
    reshard_after_forward: bool | int | None = None  # as passed; None: the default
    unshard_in_backward: bool = True
    cut_from: str | None = None  # a piece's: the group it was cut from (``with_pieces``)

    def padded(self, shard_size: int) -> int:
        """Elements once each parameter's dim 0 is padded to a multiple of the shard size."""
        total = 0
        for shape in self.shapes:
            rows = shape[0] if len(shape) else 1
            rest = shape[1:].numel() if len(shape) > 1 else 1
            total += -(-rows // shard_size) * shard_size * rest
        return total

    @property
    def n_params(self) -> int:
        return len(self.shapes)


@dataclass
class Plan:
    """A setting of one contract case; the callables take (group path, micro-batch index)."""

    label: str  # what the case sets, for messages
    groups: list[GroupSpec]
    mesh_shape: tuple[int, ...]
    micro: int = 1
    param_dtype: torch.dtype | None = None  # MixedPrecisionPolicy's, None: the parameter's own
    reduce_dtype: torch.dtype | None = None
    sync: Callable[[str, int], bool] = lambda path, m: True  # set_requires_gradient_sync
    all_reduce: Callable[[str, int], bool] = lambda path, m: True  # set_requires_all_reduce
    reshard_after_backward: Callable[[str, int], bool] = lambda path, m: True
    forward_prefetch: dict[str, list[str]] = field(default_factory=dict)  # explicit lists
    backward_prefetch: dict[str, list[str]] = field(default_factory=dict)

    @property
    def shard(self) -> int:
        return self.mesh_shape[-1]

    @property
    def replicas(self) -> int:
        return self.mesh_shape[0] if len(self.mesh_shape) == 2 else 1

    def group(self, path: str) -> GroupSpec:
        return next(g for g in self.groups if g.path == path)

    def gather_dtype(self, g: GroupSpec) -> torch.dtype:
        return self.param_dtype or g.dtypes[0]

    def grad_dtype(self, g: GroupSpec) -> torch.dtype:
        return self.reduce_dtype or self.gather_dtype(g)


@dataclass
class GroupStep:
    """What one group must do in one micro-batch."""

    path: str
    starts_unsharded: bool  # kept from the micro-batch before
    gather_forward: int | None  # ranks of its forward all-gather, None: none
    after_forward: str  # "sharded" | "piece" | "unsharded"
    gather_backward: int | None  # ranks of its backward all-gather, None: none
    ends_unsharded: bool  # set_reshard_after_backward(False) keeps it for the next micro-batch
    reduce: bool  # gradient sync: a reduce-scatter (and maybe an all-reduce) this micro-batch
    all_reduce: bool  # HSDP: the all-reduce across replicas this micro-batch
    carries_grads: bool  # unsynced gradients of earlier micro-batches wait in this one
    partial_sums: bool  # HSDP: reduce-scattered sums wait for a later all-reduce


def post_forward_ranks(spec: GroupSpec, is_root: bool, shard: int) -> int | None:
    """The ranks a group's parameters are spread over between forward and backward: the
    shard group (resharded), N (an int: a 1/N piece kept), or None (kept unsharded). As
    ``fully_shard`` decides it: the default keeps the root and reshards the others, an int
    equal to the shard size is True, and 1 is False."""
    setting = spec.reshard_after_forward
    if setting is None:
        setting = not is_root
    if setting is True or setting == shard or shard == 1:
        return shard if setting is not False else None
    if setting is False or setting == 1:
        return None
    return int(setting)


def expected(plan: Plan) -> list[dict[str, GroupStep]]:
    """Per micro-batch, what each group must do (see the module docstring)."""
    S, R = plan.shard, plan.replicas
    unsharded = {g.path: False for g in plan.groups}  # at the start of the step
    carries = {g.path: False for g in plan.groups}
    partial = {g.path: False for g in plan.groups}
    steps = []
    for m in range(plan.micro):
        here = {}
        for g in plan.groups:
            start = unsharded[g.path]
            spread = post_forward_ranks(g, g.path == "", S)
            after = "unsharded" if spread is None else ("piece" if spread < S else "sharded")
            backward = None
            if g.unshard_in_backward and after != "unsharded":
                backward = spread
            call = g.path if g.cut_from is None else g.cut_from  # a piece: its call's settings
            sync = plan.sync(call, m)
            all_reduce = sync and R > 1 and plan.all_reduce(call, m)
            keep = not plan.reshard_after_backward(call, m)
            here[g.path] = GroupStep(
                g.path,
                start,
                None if start else S,
                after,
                backward,
                keep and (after == "unsharded" or backward is not None),
                sync,
                all_reduce,
                carries[g.path],
                partial[g.path],
            )
            unsharded[g.path] = here[g.path].ends_unsharded
            carries[g.path] = not sync
            if sync:  # an all-reduce takes the partial sums along; without it they wait
                partial[g.path] = R > 1 and not all_reduce
        steps.append(here)
    return steps


def group_specs(
    model: nn.Module,
    paths: list[str],
    settings: dict[str, dict] | None = None,
    taken: set[int] | None = None,
) -> list[GroupSpec]:
    """The groups of ``model`` (unsharded) when ``fully_shard`` is applied to the modules at
    ``paths``: each holds the trainable parameters of its module that no other of ``paths``
    below it holds (nor ``taken``, by ``id``). ``settings``: per path,
    ``reshard_after_forward`` and ``unshard_in_backward``."""
    settings = settings or {}
    claimed: set[int] = set(taken or ())
    specs = []
    for path in sorted(paths, key=lambda p: -p.count(".") - (p != "")):  # children first
        module = model.get_submodule(path)
        mine = [p for p in module.parameters() if p.requires_grad and id(p) not in claimed]
        claimed.update(id(p) for p in mine)
        specs.append(
            GroupSpec(
                path, [p.shape for p in mine], [p.dtype for p in mine], **settings.get(path, {})
            )
        )
    order = {m: i for i, (m, _) in enumerate(model.named_modules())}
    return sorted(specs, key=lambda s: order[s.path])


def with_pieces(plan: Plan, model: nn.Module, recorded: list[str]) -> Plan:
    """``plan`` with every group that a recording shows cut in pieces held as groups of their
    own. A recorded group that is none of the plan's is such a piece: the modules of one call
    the implementation made itself (``norm+head``; [Note: the root's parameters in pieces] in
    ``optimized/pieces.py``). It takes the settings of the group it was cut from (the plan's
    group nearest above its first module), the root's default keeping it unsharded too, and
    that group keeps the rest of its parameters. In backward a piece may be gathered as
    early as that group ([Note: the first block in two pieces]: it is needed with it)."""
    paths = [g.path for g in plan.groups]
    pieces = [r for r in recorded if r not in paths]
    if not pieces:
        return plan
    specs = {g.path: g for g in plan.groups}
    settings = {
        g.path: dict(reshard_after_forward=g.reshard_after_forward, unshard_in_backward=g.unshard_in_backward)
        for g in plan.groups
    }  # fmt: skip
    taken: set[int] = set()
    cut = []
    for piece in pieces:
        modules = [model.get_submodule(m) for m in piece.split("+")]
        mine = [p for m in modules for p in m.parameters() if p.requires_grad]
        taken |= {id(p) for p in mine}
        first = piece.split("+")[0]
        above = max((p for p in paths if p == "" or first.startswith(p + ".")), key=len)
        kept = specs[above].reshard_after_forward
        kept = False if kept is None and above == "" else kept  # the root's default
        spec = GroupSpec(piece, [p.shape for p in mine], [p.dtype for p in mine], kept)
        spec.unshard_in_backward, spec.cut_from = specs[above].unshard_in_backward, above
        cut.append(spec)
    order = {m: i for i, (m, _) in enumerate(model.named_modules())}
    groups = group_specs(model, paths, settings, taken) + cut
    groups.sort(key=lambda g: order[g.path.split("+")[0]])
    return Plan(**{**plan.__dict__, "groups": groups})
