"""The ideal step of a job: what rank 0 would compute if FSDP cost nothing.

The ideal is recorded like any plan, as one more implementation, ``plain`` (the name
``twinshard bench`` gives the unsharded model): the same model, tokens, checkpointing and fake
mode, with no ``fully_shard`` at all. Its parameters are on the device in the job's compute
dtype (bf16 for a bf16 job, as FSDP's mixed precision gathers them), so its forward and
backward are the operators an FSDP rank runs, without any all-gather, copy, cast or
reduce-scatter around them. Its optimizer steps what an FSDP rank's optimizer steps: fp32
tensors of the shapes of the rank's shards (each parameter's dim 0 split over the shard
group, rounded up), whose gradients appear before each step at no cost; the model's own
gradients are dropped there, as FSDP takes them, so that none accumulates.

``job(plan)`` is the ideal's job for a plan, ``build(job, device, model)`` its model and
optimizer (called by ``runner.record`` inside the fake mode), and ``seconds(summary)`` the
ideal step from the ideal's summary: its compute stream's time, which, with no collective and
no second stream, is its whole step. An implementation's FSDP overhead is its planned step
minus this (``summary.add_ideal``).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from twinshard.measure import step
from twinshard.reference.collectives import padded_rows

NAME = "plain"


def job(plan):
    """The ideal's job for ``plan``: the same job, unsharded (offload and resharding, which
    only FSDP has, left at their defaults so that plans differing in them share one ideal)."""
    return replace(plan, impl=NAME, offload=False, reshard_after_forward=True, probe=False)


def build(plan, device: torch.device, model: torch.nn.Module):
    """``model`` (built on ``meta``) on ``device`` in the job's compute dtype, and an optimizer
    over fp32 stand-ins of the rank's shards (see the module docstring)."""
    model.to_empty(device=device)
    if plan.low_precision is not None:
        model.to(plan.low_precision)
    group = plan.world // plan.replicas
    shards = torch.nn.ParameterList(
        torch.empty(shard_shape(p.shape, group), device=device) for p in model.parameters()
    )
    opt = step.optimizer(shards, plan.optimizer, None if plan.cpu else True)

    def before_step(*_):
        model.zero_grad(set_to_none=True)
        for shard in shards:
            shard.grad = torch.empty_like(shard)

    opt.register_step_pre_hook(before_step)
    return model, opt


def shard_shape(shape: torch.Size, group: int) -> tuple[int, ...]:
    """A rank's block of a parameter of ``shape`` over a shard group of ``group`` ranks."""
    return (padded_rows(shape[0], group), *shape[1:]) if shape else ()


def seconds(summary: dict) -> float:
    """The ideal step (seconds) from the ideal's ``summary.summarize`` row."""
    return summary["time"]["compute_s"]
