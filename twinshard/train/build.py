"""What every rank builds before the first step: the sharded model, AdamW and its schedule.

The model is built whole on every rank from ``--seed`` (so that the initial parameters are the
same everywhere, and the same as the plain unsharded model's), then each transformer block and
finally the root go through the chosen ``fully_shard``, which keeps this rank's shard of every
parameter. ``seed_rank_rngs`` gives each rank its own random streams, derived from the seed,
the step and the rank, which is also how a run resumed at another world size re-derives them.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import torch

from twinshard.commandline.vocabulary import DTYPES
from twinshard.models import Llama, LlamaConfig

from .config import TrainConfig, load_impl


def seed_rank_rngs(seed: int, step: int, rank: int) -> None:
    """Seed this rank's RNGs from (seed, step, rank): how a run starts, and how a resumed
    run re-derives per-rank state that a checkpoint of another world size cannot supply."""
    s = ((seed * 1_000_003 + step) * 1_009 + rank) % (2**63)
    torch.manual_seed(s)  # also every CUDA device
    random.seed(s)
    np.random.seed(s % 2**32)


def build_model(cfg: TrainConfig, device: torch.device, mesh) -> torch.nn.Module:
    """The model of ``cfg``, initialized from ``cfg.seed``, sharded per block plus root."""
    fully_shard, MixedPrecision, CPUOffload = load_impl(cfg.impl)
    # Every rank builds the whole model on the CPU so the init is the same everywhere (and
    # the same as the plain model's); fully_shard then keeps this rank's part and frees the rest.
    model = Llama(LlamaConfig(**cfg.model))
    model.init_weights(cfg.seed)
    kwargs: dict[str, Any] = {"mesh": mesh}
    if cfg.param_dtype != "fp32" or cfg.reduce_dtype is not None:
        kwargs["mp_policy"] = MixedPrecision(
            param_dtype=DTYPES[cfg.param_dtype],
            reduce_dtype=DTYPES[cfg.reduce_dtype] if cfg.reduce_dtype else None,
        )
    if cfg.cpu_offload:
        kwargs["offload_policy"] = CPUOffload(pin_memory=device.type != "cpu")
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    if cfg.variants:  # each sharded module's all-gather or reduce-scatter replaced
        from twinshard import variants

        variants.attach(model, variants.parse(cfg.variants), mesh)
    return model


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module):
    """AdamW (weight decay on matrices only) and the warmup + cosine schedule."""
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

    def factor(step: int) -> float:  # multiplies --lr; a plain function, so not checkpointed
        if step < cfg.warmup:
            return (step + 1) / (cfg.warmup + 1)
        span = max(1, cfg.steps - cfg.warmup)
        progress = min(1.0, (step - cfg.warmup) / span)
        floor = cfg.min_lr / cfg.lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)
