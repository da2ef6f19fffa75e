"""The command line of ``twinshard train``: every flag, its help text and its default.

A flag left out is ``None`` after parsing, never its default: ``config.resolve`` fills it in
from ``DEFAULTS`` for a new run, or from the checkpoint on ``--resume``, so that a resumed run
keeps the settings it was started with unless the command line changes them.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from twinshard.models import PRESETS
from twinshard.watchdog import DEFAULT_HANG_TIMEOUT

from .data import BUILTIN

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_LR = {"tiny": 3e-3, "small": 1e-3, "medium": 6e-4, "1b": 3e-4}
# Defaults of the options that a resumed run otherwise takes from its checkpoint.
DEFAULTS: dict[str, Any] = dict(
    impl="optimized",
    preset="tiny",
    dim=None,
    n_layers=None,
    n_heads=None,
    data=BUILTIN,
    seq_len=128,
    batch_size=32,
    grad_accum=1,
    steps=500,
    lr=None,
    min_lr=None,
    warmup=None,
    weight_decay=0.1,
    clip_norm=1.0,
    param_dtype="fp32",
    reduce_dtype=None,
    cpu_offload=False,
    seed=0,
    checkpoint_every=100,
    keep=2,
    log_every=25,
    sample_length=160,
    eval_batches=4,
)
# Options that define the run: a resumed run must keep them (its checkpoint would not fit).
FIXED = ("seq_len", "seed", "lr", "min_lr", "warmup", "weight_decay")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the flags of ``twinshard train`` to ``p``, in four groups."""
    d = DEFAULTS
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = "Options left out on --resume are taken from the checkpoint."
    g = p.add_argument_group("parallelism")
    g.add_argument(
        "--impl",
        help="fully_shard implementation: optimized is the "
        "fast path to train with, reference the readable spec, torch "
        "torch.distributed.fsdp, or an importable module with fully_shard "
        f"(my_pkg.my_fsdp; default {d['impl']})",
    )
    g.add_argument(
        "--nproc",
        type=int,
        help="local ranks (default: one per GPU, else 2); ignored under torchrun",
    )
    g.add_argument(
        "--hsdp",
        action="store_true",
        help="hybrid sharding: replicate across nodes and shard within each (a mesh of nodes "
        "x ranks per node; under torchrun a node is an agent's LOCAL_WORLD_SIZE ranks, a local "
        "launch is one node); not remembered by checkpoints: a resumed run may change it",
    )
    g.add_argument(
        "--param-dtype",
        choices=DTYPES,
        help=f"dtype of the unsharded parameters and of the compute (default {d['param_dtype']})",
    )
    g.add_argument(
        "--reduce-dtype",
        choices=DTYPES,
        help="dtype of the gradient reduction (default: the param dtype)",
    )
    g.add_argument(
        "--cpu-offload",
        action=argparse.BooleanOptionalAction,
        help="keep sharded parameters, gradients and optimizer state on the CPU (default off)",
    )
    g.add_argument(
        "--debug",
        action="store_true",
        help="check every collective across ranks before it is issued (TWINSHARD_DEBUG=1): "
        "ranks that disagree are named, with the parameter and the step, instead of hanging",
    )
    g.add_argument(
        "--hang-timeout",
        type=float,
        metavar="SECONDS",
        help="stop the run when no rank makes progress for this long, dump every rank's "
        f"stack and name the stalled rank (default {DEFAULT_HANG_TIMEOUT:g}; 0 = off)",
    )
    g = p.add_argument_group("model and data")
    g.add_argument("--preset", choices=list(PRESETS), help=f"model size (default {d['preset']})")
    g.add_argument("--dim", type=int, help="override the preset's width")
    g.add_argument("--n-layers", type=int, help="override the preset's number of blocks")
    g.add_argument("--n-heads", type=int, help="override the preset's attention heads")
    g.add_argument(
        "--data",
        metavar="FILE",
        help="any file, read as bytes (default: the built-in generated corpus)",
    )
    g.add_argument(
        "--seq-len", type=int, help=f"tokens (bytes) per sequence (default {d['seq_len']})"
    )
    g = p.add_argument_group("optimization")
    g.add_argument(
        "--steps", type=int, help=f"optimizer steps in the whole run (default {d['steps']})"
    )
    g.add_argument(
        "--batch-size",
        type=int,
        help=f"sequences per step over all ranks (default {d['batch_size']})",
    )
    g.add_argument(
        "--grad-accum",
        type=int,
        help=f"micro-batches per step on each rank (default {d['grad_accum']})",
    )
    g.add_argument(
        "--lr",
        type=float,
        help="peak learning rate (default by preset: "
        + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_LR.items())
        + ")",
    )
    g.add_argument("--min-lr", type=float, help="final learning rate of the cosine (default lr/10)")
    g.add_argument("--warmup", type=int, help="linear warmup steps (default 5%% of --steps)")
    g.add_argument(
        "--weight-decay",
        type=float,
        help=f"AdamW weight decay of matrices (default {d['weight_decay']})",
    )
    g.add_argument(
        "--clip-norm",
        type=float,
        help=f"clip the gradient norm to this, 0 = off (default {d['clip_norm']})",
    )
    g.add_argument("--seed", type=int, help=f"model init, data order, RNGs (default {d['seed']})")
    g = p.add_argument_group("output and checkpoints")
    g.add_argument(
        "--out",
        metavar="DIR",
        help="run directory (default: runs/<date>-<time>; "
        "with --resume: the resumed run's directory)",
    )
    g.add_argument(
        "--resume",
        nargs="?",
        const="",
        metavar="PATH",
        help="continue the latest complete checkpoint of PATH (a run directory or one "
        "checkpoint); without PATH: of --out, else of the newest run under runs/",
    )
    g.add_argument(
        "--checkpoint-every",
        type=int,
        metavar="N",
        help="save every N steps and at "
        f"the end; 0 = only at the end (default {d['checkpoint_every']})",
    )
    g.add_argument(
        "--keep", type=int, metavar="N", help=f"complete checkpoints to keep (default {d['keep']})"
    )
    g.add_argument(
        "--stop-at",
        type=int,
        metavar="STEP",
        help="stop after STEP steps with a "
        "checkpoint, as if interrupted (the schedule still runs to --steps)",
    )
    g.add_argument(
        "--log-every",
        type=int,
        metavar="N",
        help=f"log a line every N steps (default {d['log_every']})",
    )
    g.add_argument(
        "--eval-batches",
        type=int,
        metavar="N",
        help="global batches of held-out "
        f"data for the final validation loss (default {d['eval_batches']})",
    )
    g.add_argument(
        "--sample-length",
        type=int,
        metavar="N",
        help=f"bytes of text to generate at the end, 0 = none (default {d['sample_length']})",
    )
