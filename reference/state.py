"""The hooks: how a sharded module learns that forward or backward is about to reach it.

``fully_shard`` attaches one ``FSDPState`` to the module. Forward is easy to intercept with
``nn.Module`` hooks. Backward has no module hooks we can rely on, so we plant two markers in
the autograd graph during forward:

- on the module's *outputs*, a tensor hook: autograd calls it when the gradient of an output
  arrives, i.e. just before backward runs through the module -> pre_backward (unshard);
- around the *inputs* of the group's first module to run, an identity autograd function: its
  backward runs once their gradients exist, after the group's backward -> post_backward (reduce).

If a module's inputs need no gradient (token ids, data) the second marker cannot be planted,
so the root also queues a callback that autograd runs when the whole backward has finished;
it completes whatever post_backward did not run and returns every group to idle.

The first module to run forward is the root. At that moment every ``fully_shard`` call has
been made, so the root looks at its whole subtree once ("lazy init").

Mixed precision happens here too, where a sharded module begins or ends (unlike autocast, the
activations saved for backward are in low precision): inputs are cast to ``param_dtype``, the
dtype parameters are gathered and computed in; outputs to ``output_dtype`` when set. Gradients
are reduced in ``reduce_dtype`` and land in the sharded parameters' own dtype.

Every hook is marked ``torch.compiler.disable``: a compiled module (``block.compile()``) runs its
hooks inside the compiled call, and the collectives and storage tricks of FSDP must run as
written, outside the graph, with the compiled forward and backward seeing plain tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.autograd import Variable

from twinshard.api import MixedPrecisionPolicy, map_tensors, profiled, tensors_in
from twinshard.api.arguments import check_materialized, raise_ran_first
from twinshard.guard import check_model, forward_started

from . import more
from .param_group import ParamGroup, TrainingState


def get_state(module: nn.Module) -> FSDPState | None:
    return module.__dict__.get("_twinshard_state")


class FSDPState:
    """What ``fully_shard`` attaches to one module: its parameter group, policy and hooks."""

    while_gathering = None  # ``ParamGroup.unshard``'s ``meanwhile``: nothing, collectives block

    def __init__(
        self,
        modules: list[nn.Module],
        group: ParamGroup | None,
        mp: MixedPrecisionPolicy,
        auto_reshard_after_forward: bool,
    ):
        self.modules = modules  # one, or several sharded as one group (fully_shard([a, b]))
        self.module = modules[0]
        self.modules_to_run: set[int] = set()  # this forward: modules not finished yet
        self.group = group  # None when every parameter belongs to sharded children
        self.mp = mp
        self.auto_reshard_after_forward = auto_reshard_after_forward
        self.is_root: bool | None = None  # decided by the first forward
        self.root: FSDPState | None = None
        self.all_states: list[FSDPState] = []  # root only: every state in its subtree
        self.callback_queued = False  # root only
        for module in modules:
            module.register_forward_pre_hook(self.pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_hook(self.post_forward, prepend=False)

    # --- lazy init -------------------------------------------------------------------------
    def lazy_init(self) -> None:
        """At the first forward: become the root of every sharded module below."""
        if self.is_root is not None:
            return
        self.is_root, self.root = True, self
        named = {id(m): (n, m) for top in self.modules for n, m in top.named_modules()}
        for name, module in named.values():
            state = get_state(module)
            if state is None or state in self.all_states:
                continue  # not sharded, or a state of several modules (a list) met again
            if state is not self:
                if state.is_root is not None:
                    raise_ran_first(name, module, self.module)  # it made itself a root
                state.is_root, state.root = False, self
            self.all_states.append(state)
            if state.group is not None:
                for p in state.group.params:  # full names, from the module that holds it
                    owner, attr = p.owners[0]
                    p.fqn = f"{named[id(owner)][0]}.{attr}".lstrip(".")
        check_materialized(self.all_states)  # nothing left on meta
        if self.auto_reshard_after_forward and self.group is not None:
            # The root's parameters are the first ones backward needs: keep them.
            self.group.post_forward_info = None
        check_model(self.module, self.all_states)  # do all ranks hold the same model?

    # --- forward: pre and post ------------------------------------------------------------------
    @torch.compiler.disable
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.lazy_init()
        if self.group is not None and self.group.state is TrainingState.PRE_BACKWARD:
            self.group.unshard()  # forward recomputed in backward (activation checkpointing)
            return self.mp.cast_inputs(args, kwargs)
        forward_started(self)  # the root counts steps, for the guard's messages
        if self.is_root and self.group is not None and self.group.device.type != "cpu":
            args, kwargs = map_tensors(lambda t: t.to(self.group.device), (args, kwargs))
        args, kwargs = self.mp.cast_inputs(args, kwargs)
        if not self.modules_to_run:  # the first of the group's modules to start forward
            self.modules_to_run = {id(m) for m in self.modules}
        if self.group is not None:
            args, kwargs = self._plant_post_backward(args, kwargs)  # first: once a pass
            self.group.pre_forward(self.while_gathering)
        return args, kwargs

    @torch.compiler.disable
    def post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.group is not None and self.group.state is TrainingState.PRE_BACKWARD:
            return self.mp.cast_output(output)  # recomputation: backward will reshard
        output = self._plant_pre_backward(output)
        self.modules_to_run.discard(id(module))
        if self.modules_to_run:
            return self.mp.cast_output(output)  # other modules of the group still to run
        if self.group is not None:
            self.group.post_forward()
        if self.is_root:
            self.finish_forward()
        return self.mp.cast_output(output)

    def finish_forward(self) -> None:
        """The root's end of forward: groups whose modules did not all run are finished."""
        for state in self.all_states:
            if state.modules_to_run:
                state.modules_to_run.clear()
                if state.group is not None:
                    state.group.post_forward()

    def reset(self) -> None:
        """After an aborted iteration: nothing half-done is left, every group is idle."""
        self.modules_to_run.clear()
        self.callback_queued = False
        if self.group is not None:
            self.group.reset()

    # --- backward: pre and post -----------------------------------------------------------------
    @torch.compiler.disable
    def pre_backward(self, grad: torch.Tensor) -> None:
        """Tensor hook on an output: backward is about to enter this module."""
        self.root.queue_final_callback()
        if self.group is not None:
            self.group.pre_backward(self.while_gathering)

    @torch.compiler.disable
    def post_backward(self) -> None:
        """Backward has left this module: reduce its gradients."""
        if self.group is not None:
            self.group.post_backward()

    # --- planting the backward markers --------------------------------------------------------------
    def _plant_pre_backward(self, output: Any) -> Any:
        if torch.is_grad_enabled():
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(self.pre_backward)
        return output

    def _plant_post_backward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not torch.is_grad_enabled() or self.group.state is TrainingState.FORWARD:
            return args, kwargs  # [a, b]'s b: its post-backward would free what a still needs
        inputs = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
        if not inputs:
            return args, kwargs  # the root's final callback will do post_backward
        marked = iter(PostBackwardMarker.apply(self, *inputs))
        swap = lambda t: next(marked) if t.requires_grad else t  # noqa: E731
        return map_tensors(swap, args), map_tensors(swap, kwargs)

    # --- end of backward (root only) ---------------------------------------------------------------
    def queue_final_callback(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            Variable._execution_engine.queue_callback(self.final_callback)

    @torch.compiler.disable
    def final_callback(self) -> None:
        """Runs once autograd has finished the whole backward."""
        self.callback_queued = False
        with profiled("twinshard::final_callback"):
            groups = self.finish_groups()
            more.wait_for_grad_copies(groups)  # offload: one wait for every copy to host memory
            more.check_usage(self, groups)  # parameters used on some ranks only

    def finish_groups(self) -> list[ParamGroup]:
        """Finish every group's backward (``ParamGroup.finish_backward``); returns the groups."""
        groups = [state.group for state in self.all_states if state.group is not None]
        for group in groups:
            group.finish_backward()
        return groups


class PostBackwardMarker(torch.autograd.Function):
    """Identity in forward; in backward, tells the state that its module is done."""

    @staticmethod
    def forward(ctx, state: FSDPState, *inputs: torch.Tensor):
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.state.post_backward()
        return (None, *grads)
