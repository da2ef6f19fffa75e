"""What a user holds of a sharded parameter stays the parameter's: views, state dicts, edits.

Trainers keep references to the sharded parameters' data and rely on them: torchtitan takes
``get_model_state_dict(model)`` once, before its first step, saves that dict at every
checkpoint and loads checkpoints back into it. Under torch's ``fully_shard`` each such
reference is a view of the parameter's local tensor, so it sees every optimizer step and
writes through to the parameter. An implementation that moves a shard into new memory behind
the user's back (at its first all-gather, say) leaves them holding the initial values: the
checkpoints are silently wrong, and a rollback restores nothing.

The rule these cases check: whatever references a parameter's sharded data after
``fully_shard``, or after an operation that gives the parameters new local tensors
(``module.to``, ``float``, ``to_empty``, ``load_state_dict(..., assign=True)``), holds the
parameter's values from then on and writes through to it.

``edit_between_forwards`` checks what a forward may read early. With the default settings a
group's forward sees an edit of its sharded parameters made right before it (by the parent's
forward, or a forward pre-hook registered with ``prepend=True``), as under torch's default
``fully_shard``, whatever an implementation prefetches. Under an explicit list
(``set_modules_to_forward_prefetch``) the group is read at the pre-forward of the module that
lists it, as torch reads it: an edit made after that may be seen from the group's next
all-gather on, and is never lost or half applied.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
from torch.distributed.tensor import DTensor

from .. import models as M
from ..compare import Checker
from ..driver import compare, run_plain, run_sharded, seeded
from .core import case
from .state_dict import dsd


def _sharded(recipe, ctx):
    """The recipe's model, built under its seed and sharded by the implementation under test."""
    model = seeded(recipe.build)
    recipe.wrap(ctx.impl, model, ctx.mesh)
    return model


def _views(model) -> dict[str, list]:
    """Every way a user commonly holds a sharded parameter's data: name -> [(how, tensor)]."""
    sd, msd = model.state_dict(), dsd().get_model_state_dict(model)
    held = {}
    for name, p in model.named_parameters():
        held[name] = [
            ("state_dict()", sd[name]),
            ("get_model_state_dict", msd[name]),
            ("to_local()", p.to_local()),
            ("detach()", p.detach()),
            (".data", p.data),
        ]
    return held


def _still_aliased(checker: Checker, label: str, held: dict, model) -> None:
    """Each held view has the live parameter's values (bitwise): it was never left behind."""
    for name, p in model.named_parameters():
        live = p.to_local()
        for how, view in held[name]:
            checker.count += 1
            local = view.to_local() if isinstance(view, DTensor) else view
            if local.shape != live.shape or not torch.equal(local, live):
                checker.fail(
                    f"{label}: the {how} of '{name}' taken then no longer holds the parameter "
                    "(its shard was moved into new memory; views and checkpoints of it are stale)"
                )


SETTINGS = {  # what aliasing must survive: the defaults, mixed precision, kept after forward
    "defaults": {},
    "bf16 compute": {"mp_policy": "bf16"},
    "reshard_after_forward=False": {"reshard_after_forward": False},
}


def _wrap_with(setting: dict):
    def wrap(impl, model, mesh):
        kwargs = dict(setting)
        if kwargs.get("mp_policy") == "bf16":
            kwargs["mp_policy"] = impl.MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        M.shard_blocks(impl, model, mesh, **kwargs)

    return wrap


@case("aliasing")
def case_views_before_training(ctx):
    """state_dict(), get_model_state_dict, to_local(), detach() and .data taken right after
    fully_shard see every step; a DCP rollback through the early state dict restores the
    parameters (torchtitan's checkpointer)."""
    import torch.distributed.checkpoint as dcp

    checker = Checker("fp32")
    for label, setting in SETTINGS.items():
        recipe = M.mlp_recipe(ctx.world, wrap=_wrap_with(setting), steps=1)
        model = _sharded(recipe, ctx)
        held = _views(model)
        early = {name: views[0][1] for name, views in held.items()}  # the state_dict() views
        first, _ = run_sharded(recipe, ctx.impl, ctx.mesh, model=model)
        _still_aliased(checker, f"{label}, after a step", held, model)
        mesh = "x".join(map(str, ctx.mesh_shape))
        name = f"aliasing-{ctx.impl_name}-{mesh}-{label}".replace(" ", "_").replace("=", "_")
        path = os.path.join(ctx.tmpdir, name)
        dcp.save(early, checkpoint_id=path)  # the early dict, as a trainer that cached it saves
        later = replace(recipe, start=1)
        run_sharded(later, ctx.impl, ctx.mesh, model=model, opt=first.optimizer)
        dcp.load(early, checkpoint_id=path)  # roll back to the first step through it
        for name, p in model.named_parameters():
            checker.count += 1
            if not torch.equal(p.to_local(), first.params[0][name]):
                checker.fail(
                    f"{label}: dcp.load into the state dict taken before training did not roll "
                    f"'{name}' back (a write through it does not reach the parameter)"
                )
    return checker


def _replace_locals(how: str, model, device) -> None:
    """Give the sharded parameters new local tensors, as users do; values stay the same."""
    if how == "to(device)":
        model.to(device)
    elif how == "float()":
        model.float()
    elif how == "to_empty":
        saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.to_empty(device=device)
        model.load_state_dict(saved)  # in place, into the new memory
    elif how == "load_state_dict(assign=True)":
        model.load_state_dict(
            {k: v.detach().clone() for k, v in model.state_dict().items()}, assign=True
        )


@case("aliasing")
def case_views_after_replacing(ctx):
    """After module.to, float(), to_empty and load_state_dict(assign=True), what is taken next
    holds the parameter through training, and training matches the plain model."""
    checker = Checker("fp32")
    recipe = M.mlp_recipe(ctx.world, steps=2)
    truth = run_plain(recipe)
    for how in ("to(device)", "float()", "to_empty", "load_state_dict(assign=True)"):
        model = _sharded(recipe, ctx)
        _replace_locals(how, model, ctx.device)
        held = _views(model)
        trace, _ = run_sharded(recipe, ctx.impl, ctx.mesh, model=model)
        compare(checker, f"after {how}", trace, truth)
        _still_aliased(checker, f"taken after {how}", held, model)
    return checker


class _Edit:
    """Halves block 1's parameters once, at the start of its forward of step ``at``
    (``where="forward"``: a pre-hook registered with ``prepend=True``, on the sharded model),
    or right after each one's gradient was accumulated in that step's backward (``"after
    backward"``: the plain model of an implementation that read the block before the edit)."""

    def __init__(self, at: int):
        self.at, self.seen = at, {}

    def once(self, key) -> bool:
        self.seen[key] = self.seen.get(key, -1) + 1
        return self.seen[key] == self.at

    def forward(self, module, args):
        if self.once("forward"):
            with torch.no_grad():
                for p in module.parameters():
                    p.mul_(0.5)

    def after_backward(self, p):
        if self.once(id(p)):
            with torch.no_grad():
                p.mul_(0.5)


def _edited_plain(where: str, at: int):
    def build():
        model = M.MLPStack(dim=15, hidden=37, n_blocks=3)
        edit = _Edit(at)
        if where == "forward":
            model.blocks[1].register_forward_pre_hook(edit.forward, prepend=True)
        else:
            for p in model.blocks[1].parameters():
                p.register_post_accumulate_grad_hook(edit.after_backward)
        return model

    return build


def _edited_sharded(at: int, explicit: bool):
    def wrap(impl, model, mesh):
        for i, block in enumerate(model.blocks):  # block 1 keeps its weights for backward
            impl.fully_shard(block, mesh=mesh, reshard_after_forward=i != 1)
        impl.fully_shard(model, mesh=mesh)
        if explicit:
            model.blocks[0].set_modules_to_forward_prefetch([model.blocks[1]])
        model.blocks[1].register_forward_pre_hook(_Edit(at).forward, prepend=True)

    return wrap


@case("aliasing")
def case_edit_between_forwards(ctx):
    """An edit of block 1's sharded weights by its own forward pre-hook (prepend=True), in the
    second step: with the default settings the forward sees it (torch's reading); under an
    explicit forward prefetch list it may also read the block before it (torch's reading
    there), with backward consistent either way, and the edit is kept."""
    checker = Checker("fp32")
    recipe = M.mlp_recipe(ctx.world, steps=3)
    seen = run_plain(replace(recipe, build=_edited_plain("forward", at=1)))
    early = run_plain(replace(recipe, build=_edited_plain("after backward", at=1)))
    for explicit in (False, True):
        label = "explicit prefetch list" if explicit else "default settings"
        sharded = replace(recipe, wrap=_edited_sharded(at=1, explicit=explicit))
        trace, _ = run_sharded(sharded, ctx.impl, ctx.mesh)
        verdicts = {}
        readings = [("at its own pre-forward", seen)]
        if explicit:  # torch reads the listed block early; the default settings never do
            readings.append(("before the edit", early))
        for reading, truth in readings:
            attempt = Checker("fp32")
            compare(attempt, f"{label}, read {reading}", trace, truth)
            verdicts[reading] = attempt
        fits = [reading for reading, attempt in verdicts.items() if attempt.ok]
        if fits:
            checker.absorb(verdicts[fits[0]])
            checker.notes.append(f"{label}: block 1 read {fits[0]}")
            continue
        closest = min(verdicts.values(), key=lambda attempt: len(attempt.failures))
        checker.count += closest.count
        missed = (
            "neither the plain model that sees the edit in the forward nor the one that "
            "applies it after that step's backward"
            if explicit
            else "not the plain model that sees the edit in the forward, as torch's default does"
        )
        checker.fail(f"{label}: the steps match {missed}; first mismatches: {closest.failures[:2]}")
    return checker
