"""Activation checkpointing for the plan: none, every block, every N-th block, or selective ops.

``apply(model, mode)`` replaces entries of ``model.blocks`` by ``Checkpointed`` wrappers
before ``fully_shard`` runs, as torchtitan does, so the wrapper is then the parameter group.
The wrappers use PyTorch's non-reentrant ``torch.utils.checkpoint.checkpoint`` (selective:
with ``create_selective_checkpoint_contexts``); the FSDP implementation's hooks stay on the
wrapper, so the recompute runs with the block's parameters still unsharded from its
pre-backward.

What each mode keeps and recomputes: docs/plan.md, ``--ac``.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    set_checkpoint_early_stop,
)

aten = torch.ops.aten
MODES = ("none", "block", "selective", "layer:N")
# kept in selective mode: attention kernels (and every other matmul, counted per forward)
ATTENTION = {
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def parse(mode: str) -> tuple[str, int]:
    """``mode`` as (kind, every): ("none", 0), ("block", 1), ("layer", N), ("selective", 1);
    a ``ValueError`` saying what is accepted otherwise."""
    if mode in ("none", "block", "selective"):
        return mode, 0 if mode == "none" else 1
    kind, _, every = mode.partition(":")
    if kind == "layer" and every.isdigit() and int(every) >= 1:
        return "layer", int(every)
    raise ValueError(f"--ac takes {', '.join(MODES)} (N >= 1), not {mode!r}")


class Checkpointed(torch.nn.Module):
    """A block whose forward is recomputed in backward (``selective``: all but the kept ops)."""

    def __init__(self, block: torch.nn.Module, selective: bool):
        super().__init__()
        self.checkpointed = block
        self.selective = selective
        # called with True as the block's forward starts (the first time or again in
        # backward) and with False as it ends
        self.watchers: list = []

    def forward(self, *args):
        context = _selective_contexts if self.selective else _no_contexts
        # [Note: no early stop] the recompute runs the block's whole forward. Stopping it
        # early (PyTorch's default) raises an exception through the autograd engine's device
        # thread, where a Python device guard (the fake accelerator's) cannot take it: the
        # process aborts. What it would skip is the block's last operators, whose outputs
        # nothing saved for backward needs.
        with set_checkpoint_early_stop(False):
            return checkpoint(self._run, *args, use_reentrant=False, context_fn=context)

    def _run(self, *args):
        for watch in self.watchers:
            watch(True)
        try:
            return self.checkpointed(*args)
        finally:
            for watch in self.watchers:
                watch(False)


def _no_contexts():
    from torch.utils.checkpoint import noop_context_fn

    return noop_context_fn()


def _selective_contexts():
    matmuls = {"count": 0}  # per forward of one block: keep the 1st, 3rd, ... matmul

    def policy(ctx, op, *args, **kwargs):
        if op in ATTENTION:
            return CheckpointPolicy.MUST_SAVE
        if op is aten.mm.default:
            matmuls["count"] += 1
            if matmuls["count"] % 2 == 1:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply(model: torch.nn.Module, mode: str) -> int:
    """Wrap ``model.blocks`` as ``mode`` says; returns how many blocks were wrapped."""
    kind, every = parse(mode)
    if kind == "none":
        return 0
    wrapped = 0
    for i, block in enumerate(model.blocks):
        if kind == "layer" and (i + 1) % every:
            continue
        model.blocks[i] = Checkpointed(block, selective=kind == "selective")
        wrapped += 1
    return wrapped
