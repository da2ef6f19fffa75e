"""Where a training step is, hook by hook: the labels the plan names time and memory by.

``Labels.attach(model)`` registers, on the sharded model, hooks that only set a label. Their
order is the point: the forward pre-hooks are prepended (``prepend=True``) and the gradient
hook on a block's output is registered from a prepended forward hook, so each runs before the
implementation's own and the all-gather a block waits for is charged to that block. The caller
sets the root's backward ("backward root" before ``loss.backward()``) and the optimizer
("optimizer step"). ``kind`` is the first word: forward, backward, recompute, optimizer;
``replay.py`` and the FLOP count group by it.

Which hook sets which label: docs/plan.md, "How the time is predicted".
"""

from __future__ import annotations

from functools import partial

import torch


class Labels:
    """The current label (see the module docstring)."""

    def __init__(self):
        self.now = "setup"
        self.kind = "setup"
        self.handles: list = []
        self.watched: list = []  # (a checkpointed block's watchers, ours among them)

    def set(self, kind: str, where: str) -> None:
        self.now, self.kind = f"{kind} {where}", kind

    def attach(self, model: torch.nn.Module) -> None:
        """Hooks on ``model`` (the root) and on each of ``model.blocks``."""
        self.handles.append(
            model.register_forward_pre_hook(lambda *_: self.set("forward", "root"), prepend=True)
        )
        for i, block in enumerate(model.blocks):
            self._attach_block(f"blocks.{i}", block, first=i == 0)

    def _attach_block(self, name: str, block: torch.nn.Module, first: bool) -> None:
        def before(module, args):
            self.set("forward", name)
            if first and args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
                args[0].register_hook(lambda grad: self.set("backward", "root"))

        def after(module, args, output):
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: self.set("backward", name))

        self.handles.append(block.register_forward_pre_hook(before, prepend=True))
        self.handles.append(block.register_forward_hook(after, prepend=True))
        self.handles.append(block.register_forward_hook(lambda *_: self.set("forward", "root")))
        watchers = getattr(block, "watchers", None)
        if watchers is not None:  # checkpointed: the block runs again in backward
            watch = partial(self._recompute, name)
            watchers.append(watch)
            self.watched.append((watchers, watch))

    def _recompute(self, name: str, starting: bool) -> None:
        if self.kind in ("backward", "recompute"):
            self.set("recompute" if starting else "backward", name)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for watchers, watch in self.watched:
            watchers.remove(watch)
        self.watched = []
