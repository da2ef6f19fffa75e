"""What a lossy run's collectives produced, checked against what its variant declares.

The yardsticks of ``lossy.py`` judge a run by where it ends, after a few steps of a small
model whose weights and gradients are tiny: an error in a few values can stay under their
tolerance. This one looks at the collectives' results themselves, on every rank and at every
step, under any implementation (torch's ``fully_shard``, the reference, the optimized path)
and without any oracle:

- **gathered**: each time a group computes (its forward, and its backward), each of its
  parameters is what the variant declares every rank computes with: ``comm.gathered`` of the
  parameter whose shards began the step, in the dtype the group computes in (the
  mixed-precision ``param_dtype``), bit for bit: the declared arithmetic is deterministic, so
  any difference is a difference of arithmetic, however small.
- **reduced**: each step's sharded gradient is ``comm.gradient_sum`` of the unsharded
  gradients the ranks of each shard group made (in the reduce dtype, in rank order), added
  over the replicas of an HSDP mesh, divided by the world and rounded to the reduce dtype,
  within one rounding step of that dtype per addition: an exact reduce-scatter or all-reduce
  adds in the backend's order. A rounding step is taken at the magnitude of what is added
  (the sum of the contributions' magnitudes, over the world), not of what the sum comes to:
  where the ranks' gradients cancel, the partial sums are larger than the result, and so are
  their roundings.

``Witness(model)`` goes on a sharded model after its variants: hooks that only read. Before
the root's forward (its hook runs before the implementation's) it keeps this rank's shard of
every parameter; after each group's pre-forward and pre-backward (its hooks run after the
implementation's), the group's unsharded parameters; a hook on each unsharded parameter keeps
the gradient this rank made for it. ``check(checker, witness, trace, comm, mesh, label)``
exchanges what every rank kept (after the run, outside its trace) and reports each difference
to ``checker`` with its size against the bound.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from twinshard.dispatch import c10d
from twinshard.dispatch.standin import paused
from twinshard.variants import fsdp_modules
from twinshard.variants.segments import Layout
from twinshard.variants.transform import chunks


class Witness:
    """Reads a sharded model's parameters and gradients as its steps run (module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.shards: list[dict] = []  # per step: name -> this rank's shard as the step began
        self.gathered: list[tuple] = []  # (step, "forward" | "backward", name, the value)
        self.grads: list[dict] = []  # per step: name -> this rank's unsharded gradient
        self.seen: set = set()  # (step, when, name) already kept
        self.grad_hooks: list = []  # on this step's unsharded parameters
        names = {id(p): n for n, p in model.named_parameters()}
        self.hooks = [model.register_forward_pre_hook(self._begin, prepend=True)]
        for _, group in fsdp_modules(model):
            owned = [names[id(p)] for p in Layout(group).params if id(p) in names]
            for module in group if isinstance(group, list) else [group]:
                look = partial(self._look, owned, "forward")
                self.hooks.append(module.register_forward_pre_hook(look))
                self.hooks.append(module.register_forward_hook(partial(self._outputs, owned)))

    def _begin(self, module, args) -> None:
        if not torch.is_grad_enabled():
            return
        for handle in self.grad_hooks:
            handle.remove()
        self.grad_hooks = []
        params = self.model.named_parameters()
        self.shards.append({n: p.to_local().detach().clone() for n, p in params if _sharded(p)})
        self.grads.append({})

    def _look(self, names: list[str], when: str, *_) -> None:
        step = len(self.shards) - 1
        for name in names:
            t = self.model.get_parameter(name)
            if step < 0 or isinstance(t, DTensor) or (step, when, name) in self.seen:
                continue  # sharded now: not gathered for this group, or kept already
            self.seen.add((step, when, name))
            self.gathered.append((step, when, name, t.detach().clone()))
            if when == "forward" and t.requires_grad:
                self.grad_hooks.append(t.register_hook(partial(self._grad, step, name)))

    def _grad(self, step: int, name: str, grad: torch.Tensor) -> None:
        kept = self.grads[step]
        kept[name] = grad.detach().clone() if name not in kept else kept[name] + grad

    def _outputs(self, names: list[str], module, args, output) -> None:
        if torch.is_grad_enabled():
            for t in c10d.tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda grad: self._look(names, "backward"))

    def remove(self) -> None:
        for handle in self.hooks + self.grad_hooks:
            handle.remove()


def check(checker, witness: Witness, trace, comm, mesh, label: str, reduce_dtype=None) -> None:
    """Every gathered parameter and every step's sharded gradient of one run against
    ``comm``'s declarations (module docstring), on ``mesh`` (1D, or 2D HSDP); what differs
    goes to ``checker`` as a failure naming the run (``label``), the step and the parameter."""
    checker.count += 1
    with paused():
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (witness.shards, witness.grads))
    rows = mesh.mesh.reshape(-1, mesh.mesh.shape[-1]).tolist()  # (replicas, shard ranks)
    me = dist.get_rank()
    mine = next(row for row in rows if me in row)
    gathered_failures(checker, witness, [everyone[r][0] for r in mine], comm, label)
    contributions = [[everyone[r][1] for r in row] for row in rows]
    reduced_failures(checker, trace, contributions, mine.index(me), comm, label, reduce_dtype)


def gathered_failures(checker, witness: Witness, shards: list, comm, label: str) -> None:
    """Each kept unsharded parameter against the transform of the shards (``shards``: the
    shard group's ranks' kept shards, in rank order) it was gathered from."""
    ranks, worst = len(shards), {}
    for step, when, name, value in witness.gathered:
        full = torch.cat([s[step][name] for s in shards])  # Shard(0): the parameter, unpadded
        expected = comm.gathered(full.to(value.dtype), ranks).view_as(value)
        if not torch.equal(value, expected):
            off = (value.float() - expected.float()).abs()
            worst.setdefault(
                name, (step, when, off.max().item(), int((off > 0).sum()), off.numel())
            )
    for name, (step, when, most, count, numel) in worst.items():
        checker.fail(
            f"{label}: {name} as gathered in step {step}'s {when} is not the declared transform "
            f"of its shards: {count} of {numel} values differ, by up to {most:.3g}"
        )


def reduced_failures(checker, trace, grads: list, index: int, comm, label: str, dtype) -> None:
    """Each step's sharded gradient (``trace.grads``) against the declared sum of the ranks'
    unsharded gradients (``grads[replica][rank in the shard group][step]``); ``index``: this
    rank's place in its shard group."""
    replicas, ranks = len(grads), len(grads[0])
    margins = []
    for step, observed in enumerate(trace.grads):
        for name, local in observed.items():
            made = [[g[step].get(name) for g in row] for row in grads]
            like = next((c for row in made for c in row if c is not None), None)
            if local is None or like is None:
                continue
            sums = [comm.gradient_sum([_as(c, like, dtype) for c in row], ranks) for row in made]
            total = sum(sums[1:], sums[0]).to(torch.float32) / (replicas * ranks)
            total = total.to(dtype or total.dtype).float()  # the reduce's output, its dtype
            expected = chunks(total, ranks)[index][: local.numel()].view_as(local)
            off = (local.float() - expected).abs().max().item()
            eps = torch.finfo(dtype or torch.float32).eps
            added = sum(
                _as(c, like, dtype).float().abs() for row in made for c in row if c is not None
            )
            added = chunks(added / (replicas * ranks), ranks)[index][: local.numel()]
            bound = (ranks + replicas) * eps * max(added.max().item(), 1e-30)
            margins.append(off / bound)
            if off > bound:
                checker.fail(
                    f"{label}: {name}'s sharded gradient in step {step} is not the declared sum "
                    f"of the ranks' gradients: off by {off:.3g}, {off / bound:.1f}x the bound "
                    f"of one rounding step per addition ({bound:.3g})"
                )
    if margins:
        checker.notes.append(f"{label}: gradients at most {max(margins):.2f}x their bound")


def _as(made, like: torch.Tensor, dtype) -> torch.Tensor:
    """A rank's gradient in the reduce dtype; zeros where the rank made none."""
    grad = torch.zeros_like(like) if made is None else made
    return grad.to(dtype or grad.dtype)


def _sharded(p) -> bool:
    """A parameter sharded by rows (what ``comm.gathered`` cuts): the lossy cases' only kind."""
    return isinstance(p, DTensor) and p.placements[-1] == Shard(0)
