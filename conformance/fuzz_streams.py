"""What the fuzzer adds for the accelerator schedule: stand-in streams under the sanitizer, and
an assign-load after the post-optimizer event.

``stand_in_streams`` runs the optimized roots built inside it on stand-in streams and checks
every tensor access against their order (``twinshard/dispatch/standin.py``), as ``twinshard conform
--stand-in-streams`` does for the cases. ``reloads_after_steps`` hooks every optimizer step: the
root is handed an event recorded after the step, as a training loop on an accelerator does
(``set_post_optim_event``), and the model's own state dict is loaded back with ``assign=True``,
so that the next all-gather must adopt a new ``DTensor`` for every parameter, and order its
copy-in after the compute stream that wrote them there (issue 23, hazard 5).
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from twinshard.optimized.streams import STANDIN_ENV, streams_for


def assign_load(model: nn.Module, opt: torch.optim.Optimizer, new_memory: bool) -> None:
    """Load ``model``'s own state dict back with ``assign=True``: every parameter becomes a new
    ``DTensor`` (a tied one stays tied), cloned with ``new_memory``, else the state dict's own
    tensors; ``opt`` then steps the new parameters, with their state (momentum)."""
    before = dict(model.named_parameters())
    params = dict(model.named_parameters(remove_duplicate=False))
    state, fresh = model.state_dict(), {}
    for name, value in state.items():
        if (p := params.get(name)) is not None:
            if id(p) not in fresh:
                data = value.detach().clone() if new_memory else value
                fresh[id(p)] = nn.Parameter(data, requires_grad=p.requires_grad)
            state[name] = fresh[id(p)]
    model.load_state_dict(state, assign=True)
    after = dict(model.named_parameters(remove_duplicate=False))
    moved = {id(p): after[name] for name, p in before.items()}
    for group in opt.param_groups:
        group["params"] = [moved.get(id(p), p) for p in group["params"]]
    for p in list(opt.state):
        if moved.get(id(p), p) is not p:
            opt.state[moved[id(p)]] = opt.state.pop(p)


@contextlib.contextmanager
def reloads_after_steps(reload: str | None, wrapped: dict):
    """While inside: after every optimizer step, hand ``wrapped["model"]`` an event recorded
    after the step (``set_post_optim_event``; on stand-in streams a stand-in event, on the CPU's
    streams ``None``) and then ``assign_load`` it, in new memory when ``reload`` is
    ``"new_memory"``, in the state dict's own when ``"same_memory"``; nothing when None."""
    if reload is None:
        yield
        return

    def after_step(opt, args, kwargs):
        model = wrapped["model"]
        model.set_post_optim_event(streams_for(torch.device("cpu")).current().record_event())
        assign_load(model, opt, new_memory=reload == "new_memory")

    handle = register_optimizer_step_post_hook(after_step)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def stand_in_streams(on: bool):
    """While inside, with ``on``: the roots that ``twinshard.optimized`` builds run their
    accelerator schedule on stand-in streams, and every tensor access is checked against their
    order (``StreamOrderError`` at the first a device could get wrong); nothing without."""
    if not on:
        yield
        return
    from twinshard.dispatch.standin import standin_streams

    before = os.environ.get(STANDIN_ENV)
    os.environ[STANDIN_ENV] = "1"  # read when a root's streams are made (streams_for)
    try:
        with standin_streams().checking():
            yield
    finally:
        if before is None:
            del os.environ[STANDIN_ENV]
        else:
            os.environ[STANDIN_ENV] = before
