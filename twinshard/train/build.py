"""What every rank builds before the first step: the sharded model, AdamW and its schedule.

The model is built whole on every rank from ``--seed`` (so that the initial parameters are the
same everywhere, and the same as the plain unsharded model's), then each transformer block and
finally the root go through the chosen ``fully_shard``, which keeps this rank's shard of every
parameter: ``twinshard.measure.step.shard`` does it, the step builder every measuring command
shards through, given the job ``sharding_job`` reads from the training config.
``seed_rank_rngs`` gives each rank its own random streams, derived from the seed, the step and
the rank, which is also how a run resumed at another world size re-derives them.
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from twinshard.commandline.impls import SHORT_NAMES, module_name
from twinshard.local_step import local_step
from twinshard.measure.job import Job
from twinshard.measure.step import shard
from twinshard.models import Llama, LlamaConfig

from .config import TrainConfig


def seed_rank_rngs(seed: int, step: int, rank: int) -> None:
    """Seed this rank's RNGs from (seed, step, rank): how a run starts, and how a resumed
    run re-derives per-rank state that a checkpoint of another world size cannot supply."""
    s = ((seed * 1_000_003 + step) * 1_009 + rank) % (2**63)
    torch.manual_seed(s)  # also every CUDA device
    random.seed(s)
    np.random.seed(s % 2**32)


def build_model(cfg: TrainConfig, device: torch.device, mesh) -> torch.nn.Module:
    """The model of ``cfg``, initialized from ``cfg.seed``, sharded per block plus root on
    ``mesh`` by the measuring package's one step builder (``twinshard.measure.step.shard``)."""
    # Every rank builds the whole model on the CPU so the init is the same everywhere (and
    # the same as the plain model's); fully_shard then keeps this rank's part and frees the rest.
    model = Llama(LlamaConfig(**cfg.model))
    model.init_weights(cfg.seed)
    shard(model, sharding_job(cfg), device, on=mesh)
    return model


def sharding_job(cfg: TrainConfig) -> Job:
    """What ``shard`` reads of a job, as ``cfg`` says it: the implementation, CPU offload,
    the communication variants and the mixed-precision policy as train has always made it:
    none while the parameters stay fp32 and no reduce dtype is given, else one naming both
    (fp32 parameters with a bf16 reduction name fp32). Blocks reshard after forward."""
    policy = cfg.param_dtype != "fp32" or cfg.reduce_dtype is not None
    return Job(
        impl=cfg.impl,
        param_dtype=cfg.param_dtype if policy else None,
        reduce_dtype=cfg.reduce_dtype if policy else None,
        offload=cfg.cpu_offload,
        variants=cfg.variants,
    )


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module):
    """AdamW (weight decay on matrices only) and the warmup + cosine schedule; a twinshard
    implementation's AdamW steps the local shards (``twinshard.local_step``)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    if module_name(cfg.impl) != SHORT_NAMES["torch"]:  # torch's runs as torch's users run it
        local_step(opt)  # over the local shards: the same bits without DTensor's dispatch

    def factor(step: int) -> float:  # multiplies --lr; a plain function, so not checkpointed
        if step < cfg.warmup:
            return (step + 1) / (cfg.warmup + 1)
        span = max(1, cfg.steps - cfg.warmup)
        progress = min(1.0, (step - cfg.warmup) / span)
        floor = cfg.min_lr / cfg.lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)
