"""Train a small Llama-style language model with FSDP, end to end, with checkpoints that survive.

    twinshard train                                  # ~2 min on 2 CPU ranks, built-in corpus
    twinshard train --data book.txt --steps 2000 --preset small --nproc 4
    twinshard train --resume runs/20250101-120000     # continue the latest complete checkpoint
    torchrun --nnodes 2 --nproc-per-node 8 -m twinshard.cli train --preset 1b ...

What happens. Every rank builds the same model (``twinshard.models.Llama``, initialized from
``--seed``), shards each transformer block and then the root with the chosen ``fully_shard``
(``--impl``), and trains it with AdamW, a linear warmup and a cosine decay. The global batch
of ``--batch-size`` sequences is split evenly: each rank reads its own contiguous part of it
(``twinshard.data``), in ``--grad-accum`` micro-batches whose gradients are reduced only after
the last one (``set_requires_gradient_sync``). Rank 0 shows a progress line (loss, tokens/s,
memory) and writes ``train.log``, ``loss.csv`` and ``loss.png`` into the run directory
(``--out``). Checkpoints (``twinshard.checkpoint``) are written every ``--checkpoint-every``
steps and at the end; ``--resume`` continues one, at any number of ranks, and ends with the
same parameters as a run that was never interrupted.

Local or ``torchrun``. Without ``RANK``/``WORLD_SIZE`` in the environment this process starts
``--nproc`` local ranks with ``twinshard.launch``; under ``torchrun`` (or any launcher that
sets them) it is one of the ranks, joins the process group itself and ignores ``--nproc``.

Options left out on ``--resume`` are taken from the checkpoint. Options that fix what the run
is (model shape, data, sequence length, seed, learning-rate schedule) cannot change on resume;
the others (steps, batch size, ranks, precision, ...) can, and the log says what changed.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from twinshard import checkpoint as ckpt
from twinshard.data import BUILTIN, DataError, Windows, load_corpus
from twinshard.models import PRESETS, Llama, LlamaConfig

IMPLS = ("reference", "optimized", "torch")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_LR = {"tiny": 3e-3, "small": 1e-3, "medium": 6e-4, "1b": 3e-4}
# Defaults of the options that a resumed run otherwise takes from its checkpoint.
DEFAULTS: dict[str, Any] = dict(
    impl="reference", preset="tiny", dim=None, n_layers=None, n_heads=None, data=BUILTIN,
    seq_len=128, batch_size=32, grad_accum=1, steps=500, lr=None, min_lr=None, warmup=None,
    weight_decay=0.1, clip_norm=1.0, param_dtype="fp32", reduce_dtype=None, cpu_offload=False,
    seed=0, checkpoint_every=100, keep=2, log_every=25, sample_length=160, eval_batches=4,
)
# Options that define the run: a resumed run must keep them (its checkpoint would not fit).
FIXED = ("seq_len", "seed", "lr", "min_lr", "warmup", "weight_decay")
RUN_TIMEOUT = 30 * 24 * 3600.0  # launch's deadline; a dead rank is noticed at once anyway


class TrainError(ValueError):
    """The run cannot start or continue; the message says what to change."""


# ---------------------------------------------------------------------------- arguments
def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = "Options left out on --resume are taken from the checkpoint."
    g = p.add_argument_group("parallelism")
    g.add_argument("--impl", choices=IMPLS, help=f"fully_shard implementation (default {d['impl']})")
    g.add_argument("--nproc", type=int, help="local ranks (default: one per GPU, else 2); "
                   "ignored under torchrun")
    g.add_argument("--param-dtype", choices=DTYPES, help="dtype of the unsharded parameters and "
                   f"of the compute (default {d['param_dtype']})")
    g.add_argument("--reduce-dtype", choices=DTYPES, help="dtype of the gradient reduction "
                   "(default: the param dtype)")
    g.add_argument("--cpu-offload", action=argparse.BooleanOptionalAction,
                   help="keep sharded parameters, gradients and optimizer state on the CPU "
                   "(default off)")
    g = p.add_argument_group("model and data")
    g.add_argument("--preset", choices=list(PRESETS), help=f"model size (default {d['preset']})")
    g.add_argument("--dim", type=int, help="override the preset's width")
    g.add_argument("--n-layers", type=int, help="override the preset's number of blocks")
    g.add_argument("--n-heads", type=int, help="override the preset's attention heads")
    g.add_argument("--data", metavar="FILE", help="any file, read as bytes (default: the "
                   "built-in generated corpus)")
    g.add_argument("--seq-len", type=int, help=f"tokens (bytes) per sequence (default {d['seq_len']})")
    g = p.add_argument_group("optimization")
    g.add_argument("--steps", type=int, help=f"optimizer steps in the whole run (default {d['steps']})")
    g.add_argument("--batch-size", type=int, help="sequences per step over all ranks "
                   f"(default {d['batch_size']})")
    g.add_argument("--grad-accum", type=int, help="micro-batches per step on each rank "
                   f"(default {d['grad_accum']})")
    g.add_argument("--lr", type=float, help="peak learning rate (default by preset: "
                   + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_LR.items()) + ")")
    g.add_argument("--min-lr", type=float, help="final learning rate of the cosine (default lr/10)")
    g.add_argument("--warmup", type=int, help="linear warmup steps (default 5%% of --steps)")
    g.add_argument("--weight-decay", type=float, help=f"AdamW weight decay of matrices "
                   f"(default {d['weight_decay']})")
    g.add_argument("--clip-norm", type=float, help="clip the gradient norm to this, 0 = off "
                   f"(default {d['clip_norm']})")
    g.add_argument("--seed", type=int, help=f"model init, data order, RNGs (default {d['seed']})")
    g = p.add_argument_group("output and checkpoints")
    g.add_argument("--out", metavar="DIR", help="run directory (default: runs/<date>-<time>; "
                   "with --resume: the resumed run's directory)")
    g.add_argument("--resume", nargs="?", const="", metavar="PATH",
                   help="continue the latest complete checkpoint of PATH (a run directory or one "
                   "checkpoint); without PATH: of --out, else of the newest run under runs/")
    g.add_argument("--checkpoint-every", type=int, metavar="N", help="save every N steps and at "
                   f"the end; 0 = only at the end (default {d['checkpoint_every']})")
    g.add_argument("--keep", type=int, metavar="N", help="complete checkpoints to keep "
                   f"(default {d['keep']})")
    g.add_argument("--stop-at", type=int, metavar="STEP", help="stop after STEP steps with a "
                   "checkpoint, as if interrupted (the schedule still runs to --steps)")
    g.add_argument("--log-every", type=int, metavar="N", help=f"log a line every N steps "
                   f"(default {d['log_every']})")
    g.add_argument("--eval-batches", type=int, metavar="N", help="global batches of held-out "
                   f"data for the final validation loss (default {d['eval_batches']})")
    g.add_argument("--sample-length", type=int, metavar="N", help="bytes of text to generate "
                   f"at the end, 0 = none (default {d['sample_length']})")


# --------------------------------------------------------------------- the resolved config
@dataclass
class TrainConfig:
    """Every setting of a run, resolved and checked (picklable: it travels to the ranks)."""

    impl: str
    preset: str
    dim: int | None
    n_layers: int | None
    n_heads: int | None
    data: str
    seq_len: int
    batch_size: int
    grad_accum: int
    steps: int
    lr: float
    min_lr: float
    warmup: int
    weight_decay: float
    clip_norm: float
    param_dtype: str
    reduce_dtype: str | None
    cpu_offload: bool
    seed: int
    checkpoint_every: int
    keep: int
    log_every: int
    sample_length: int
    eval_batches: int
    # not part of what a checkpoint remembers:
    nproc: int = 1
    out: str | None = None
    stop_at: int | None = None
    resume_from: str | None = None  # a complete checkpoint directory
    model: dict = field(default_factory=dict)  # the LlamaConfig fields
    data_fingerprint: str = ""
    notes: list = field(default_factory=list)  # for the log, from the resolution

    def remembered(self) -> dict:
        """The settings a checkpoint stores and a resumed run starts from."""
        return {k: getattr(self, k) for k in DEFAULTS}


def _torchrun_env() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _default_nproc() -> int:
    return torch.cuda.device_count() or 2


def resolve(args: argparse.Namespace) -> TrainConfig:
    """Turn the command line (and a checkpoint, on --resume) into a checked ``TrainConfig``."""
    given = {k: getattr(args, k) for k in DEFAULTS if getattr(args, k, None) is not None}
    if given.get("data", BUILTIN) != BUILTIN:  # a resumed run may start in another directory
        given["data"] = os.path.abspath(given["data"])
    resume_from, manifest = _find_resume(args)
    base = dict(DEFAULTS)
    notes = []
    if manifest is not None:
        saved = manifest["config"]
        base.update({k: v for k, v in saved.items() if k in DEFAULTS})
        for k, v in given.items():
            if k in FIXED and saved.get(k) != v:
                raise TrainError(f"--{k.replace('_', '-')} {v} does not match the checkpoint "
                                 f"({saved.get(k)}); a resumed run keeps it: leave it out, or "
                                 "start a new run (without --resume) to change it")
            if k in saved and saved[k] != v:
                notes.append(f"--{k.replace('_', '-')} changed on resume: {saved[k]} -> {v}")
    values = {**base, **given}
    if values["lr"] is None:
        values["lr"] = DEFAULT_LR[values["preset"]]
    if values["min_lr"] is None:
        values["min_lr"] = values["lr"] / 10
    if values["warmup"] is None:
        values["warmup"] = round(0.05 * values["steps"])
    cfg = TrainConfig(**values, nproc=args.nproc or _default_nproc(), stop_at=args.stop_at,
                      resume_from=str(resume_from) if resume_from else None, notes=notes)
    _check_numbers(cfg)
    cfg.model = _model_config(cfg)
    try:
        corpus = load_corpus(cfg.data, cfg.seq_len)
    except DataError as e:
        raise TrainError(str(e)) from e
    cfg.data_fingerprint = corpus.fingerprint
    if manifest is not None:
        _check_fits_checkpoint(cfg, manifest)
    cfg.out = _output_dir(args, cfg, resume_from)
    _check_impl(cfg.impl)
    return cfg


def _find_resume(args) -> tuple[Path | None, dict | None]:
    if args.resume is None:
        return None, None
    if args.resume:
        where = Path(args.resume)
    elif args.out:
        where = Path(args.out)
    else:
        runs = [p for p in Path("runs").glob("*") if ckpt.complete_checkpoints(ckpt.checkpoints_root(p))]
        if not runs:
            raise TrainError("--resume without a PATH looks for the newest run under runs/, and "
                             "there is none with a checkpoint; pass the run directory: --resume DIR")
        where = max(runs, key=lambda p: ckpt.complete_checkpoints(ckpt.checkpoints_root(p))[-1].stat().st_mtime)
    try:
        checkpoint = ckpt.resolve(where)
        return checkpoint, ckpt.validate(checkpoint)
    except ckpt.CheckpointError as e:
        raise TrainError(str(e)) from e


def _check_numbers(cfg: TrainConfig) -> None:
    positive = {"steps": cfg.steps, "batch_size": cfg.batch_size, "grad_accum": cfg.grad_accum,
                "seq_len": cfg.seq_len, "nproc": cfg.nproc, "keep": cfg.keep,
                "log_every": cfg.log_every, "lr": cfg.lr}
    nonneg = {"min_lr": cfg.min_lr, "warmup": cfg.warmup, "weight_decay": cfg.weight_decay,
              "clip_norm": cfg.clip_norm, "checkpoint_every": cfg.checkpoint_every,
              "sample_length": cfg.sample_length, "eval_batches": cfg.eval_batches}
    for name, v in positive.items():
        if not v > 0 or (isinstance(v, float) and not math.isfinite(v)):
            raise TrainError(f"--{name.replace('_', '-')} must be positive, got {v}")
    for name, v in nonneg.items():
        if not v >= 0 or (isinstance(v, float) and not math.isfinite(v)):
            raise TrainError(f"--{name.replace('_', '-')} must be >= 0, got {v}")
    if cfg.min_lr > cfg.lr:
        raise TrainError(f"--min-lr {cfg.min_lr:g} is above --lr {cfg.lr:g}; the cosine decays "
                         "from --lr down to --min-lr")
    world = int(os.environ["WORLD_SIZE"]) if _torchrun_env() else cfg.nproc
    split = world * cfg.grad_accum
    if cfg.batch_size % split:
        near = max(split, round(cfg.batch_size / split) * split)
        raise TrainError(f"--batch-size {cfg.batch_size} cannot be split evenly over {world} "
                         f"rank(s) x {cfg.grad_accum} micro-batch(es); use a multiple of {split}, "
                         f"e.g. --batch-size {near}")
    gpus = torch.cuda.device_count()
    if not _torchrun_env() and gpus and cfg.nproc > gpus:
        raise TrainError(f"--nproc {cfg.nproc} but only {gpus} GPU(s): NCCL needs one GPU per "
                         f"rank; use --nproc {gpus} or fewer")
    if cfg.stop_at is not None and not 0 < cfg.stop_at <= cfg.steps:
        raise TrainError(f"--stop-at {cfg.stop_at} must be between 1 and --steps {cfg.steps}")


def _model_config(cfg: TrainConfig) -> dict:
    preset = PRESETS[cfg.preset]
    overrides = {k: v for k, v in (("dim", cfg.dim), ("n_layers", cfg.n_layers),
                                   ("n_heads", cfg.n_heads)) if v is not None}
    if "n_heads" in overrides and "n_kv_heads" in preset:
        overrides["n_kv_heads"] = None  # a preset's grouping may not divide the new head count
    max_len = max(preset.get("max_seq_len", LlamaConfig.max_seq_len), cfg.seq_len)
    try:
        model = LlamaConfig.preset(cfg.preset, **overrides, max_seq_len=max_len)
    except ValueError as e:
        raise TrainError(f"model: {e}; change --dim / --n-heads") from e
    if model.vocab_size < 256:
        raise TrainError(f"the model's vocabulary ({model.vocab_size}) is smaller than the 256 "
                         "byte values the data uses")
    return dataclasses.asdict(model)


def _check_fits_checkpoint(cfg: TrainConfig, manifest: dict) -> None:
    where = f"checkpoint {cfg.resume_from}"
    if manifest["model"] != cfg.model:
        diff = ", ".join(f"{k} {manifest['model'].get(k)} vs {v}" for k, v in cfg.model.items()
                         if manifest["model"].get(k) != v)
        raise TrainError(f"{where} holds another model (preset {manifest['config'].get('preset')!r}, "
                         f"this run asks for {cfg.preset!r}; checkpoint vs this run: {diff}); "
                         "leave out --preset/--dim/--n-layers/--n-heads to continue it, or "
                         "start a new run without --resume")
    if manifest.get("data_fingerprint") != cfg.data_fingerprint:
        raise TrainError(f"{where} was trained on other data ({manifest['config'].get('data')}, "
                         f"{manifest.get('data_fingerprint')}) than --data {cfg.data} "
                         f"({cfg.data_fingerprint}); its data position would be meaningless. "
                         "Pass the same data, or start a new run without --resume")
    step = manifest["step"]
    if step >= cfg.steps:
        raise TrainError(f"{where} is already at step {step} of --steps {cfg.steps}; pass a "
                         "larger --steps to train further")
    if cfg.stop_at is not None and cfg.stop_at <= step:
        raise TrainError(f"--stop-at {cfg.stop_at} is not after the checkpoint's step {step}")
    if manifest["world_size"] != (int(os.environ["WORLD_SIZE"]) if _torchrun_env() else cfg.nproc):
        cfg.notes.append("world size changed on resume: the sharded state is resharded by DCP")


def _output_dir(args, cfg: TrainConfig, resume_from: Path | None) -> str | None:
    """The run directory, checked so that nothing of another run is overwritten."""
    if args.out:
        out = Path(args.out)
    elif resume_from is not None:
        out = ckpt.run_dir_of(resume_from)
    elif _torchrun_env():
        return None  # rank 0 picks the name after joining and tells the others
    else:
        out = _fresh_run_name()
    if out.exists() and not out.is_dir():
        raise TrainError(f"--out {out} exists and is not a directory; choose another --out")
    existing = ckpt.complete_checkpoints(ckpt.checkpoints_root(out))
    same_run = resume_from is not None and ckpt.run_dir_of(resume_from).resolve() == out.resolve()
    if same_run:
        newer = [p.name for p in existing if p.resolve() != resume_from.resolve()
                 and int(p.name.split("_")[1]) > int(ckpt.validate(resume_from)["step"])]
        if newer:
            raise TrainError(f"resuming {resume_from} inside its own run would overwrite the newer "
                             f"checkpoint(s) {', '.join(newer)}; resume the latest one "
                             f"(--resume {out}) or write elsewhere with --out NEW_DIR")
    elif existing or (out / "train.log").exists():
        raise TrainError(f"{out} already holds a training run; continue it with --resume {out}, "
                         "or choose another --out (nothing was changed)")
    return str(out)


def _fresh_run_name() -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out, n = Path("runs") / stamp, 1
    while out.exists():
        n += 1
        out = Path("runs") / f"{stamp}-{n}"
    return out


def _check_impl(name: str) -> None:
    _load_impl(name)  # raises TrainError when it is not usable


def _load_impl(name: str):
    """(fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy) of an implementation."""
    from twinshard import api
    if name == "reference":
        import twinshard.reference as module
    elif name == "torch":
        import torch.distributed.fsdp as module
    elif name == "optimized":
        import twinshard.optimized as module
        if not hasattr(module, "fully_shard"):
            raise TrainError("--impl optimized: twinshard.optimized is not available yet (its "
                             "fully_shard is not written); use --impl reference or --impl torch")
    else:
        raise TrainError(f"unknown --impl {name!r}; choose from {', '.join(IMPLS)}")
    return (module.fully_shard, getattr(module, "MixedPrecisionPolicy", api.MixedPrecisionPolicy),
            getattr(module, "CPUOffloadPolicy", api.CPUOffloadPolicy))


# ------------------------------------------------------------------------ building blocks
def seed_rank_rngs(seed: int, step: int, rank: int) -> None:
    """Seed this rank's RNGs from (seed, step, rank): how a run starts, and how a resumed
    run re-derives per-rank state that a checkpoint of another world size cannot supply."""
    s = ((seed * 1_000_003 + step) * 1_009 + rank) % (2**63)
    torch.manual_seed(s)  # also every CUDA device
    random.seed(s)
    np.random.seed(s % 2**32)


def build_model(cfg: TrainConfig, device: torch.device, mesh) -> torch.nn.Module:
    """The model of ``cfg``, initialized from ``cfg.seed``, sharded per block plus root."""
    fully_shard, MixedPrecision, CPUOffload = _load_impl(cfg.impl)
    # Every rank builds the whole model on the CPU so the init is the same everywhere (and
    # the same as the plain model's); fully_shard then keeps this rank's part and frees the rest.
    model = Llama(LlamaConfig(**cfg.model))
    model.init_weights(cfg.seed)
    kwargs: dict[str, Any] = {"mesh": mesh}
    if cfg.param_dtype != "fp32" or cfg.reduce_dtype is not None:
        kwargs["mp_policy"] = MixedPrecision(
            param_dtype=DTYPES[cfg.param_dtype],
            reduce_dtype=DTYPES[cfg.reduce_dtype] if cfg.reduce_dtype else None)
    if cfg.cpu_offload:
        kwargs["offload_policy"] = CPUOffload(pin_memory=device.type == "cuda")
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module):
    """AdamW (weight decay on matrices only) and the warmup + cosine schedule."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95))

    def factor(step: int) -> float:  # multiplies --lr; a plain function, so not checkpointed
        if step < cfg.warmup:
            return (step + 1) / (cfg.warmup + 1)
        span = max(1, cfg.steps - cfg.warmup)
        progress = min(1.0, (step - cfg.warmup) / span)
        floor = cfg.min_lr / cfg.lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def train_step(model, opt, windows: Windows, position: int, cfg: TrainConfig,
               rank: int, world: int, device: torch.device) -> torch.Tensor:
    """One optimizer step on the global batch at ``position``; returns this rank's mean loss."""
    x, y = windows.rank_batch(position, cfg.batch_size, rank, world)  # (B / W, T) each
    x, y = x.to(device), y.to(device)
    micro = x.shape[0] // cfg.grad_accum
    total = torch.zeros((), device=device)
    for k in range(cfg.grad_accum):
        last = k == cfg.grad_accum - 1
        if cfg.grad_accum > 1:  # reduce only the summed gradient of the last micro-batch
            model.set_requires_gradient_sync(last)
        rows = slice(k * micro, (k + 1) * micro)
        loss = model(x[rows], y[rows])  # mean over this micro-batch's tokens
        # Each rank's gradient is the mean over its micro-batches, and FSDP averages over the
        # ranks: the step sees the mean over the global batch, whatever W and grad_accum are.
        (loss / cfg.grad_accum).backward()
        total += loss.detach()
    if cfg.clip_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total / cfg.grad_accum


def global_mean(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


@torch.no_grad()
def evaluate(model, windows: Windows, cfg: TrainConfig, rank: int, world: int,
             device: torch.device) -> float:
    """Mean loss over ``eval_batches`` global batches of held-out data."""
    total = torch.zeros((), device=device)
    for b in range(cfg.eval_batches):
        x, y = windows.rank_batch(b * cfg.batch_size, cfg.batch_size, rank, world)
        total += model(x.to(device), y.to(device))
    return global_mean(total / cfg.eval_batches)


@torch.no_grad()
def generate(model, prompt: bytes, length: int, seq_len: int, seed: int,
             device: torch.device) -> str:
    """Sample ``length`` bytes after ``prompt``; rank 0 draws, every rank runs the model."""
    tokens = torch.tensor([list(prompt)], device=device)  # (1, t)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(length):
        logits = model(tokens[:, -seq_len:])[0, -1, :256].float().cpu()  # (256,) bytes only
        nxt = torch.multinomial(F.softmax(logits / 0.7, dim=-1), 1, generator=gen)  # (1,)
        nxt = nxt.to(device)
        dist.broadcast(nxt, src=0)  # one rank decides, so all feed the same next input
        tokens = torch.cat([tokens, nxt[None]], dim=1)  # (1, t + 1)
    return bytes(tokens[0].tolist()).decode("utf-8", errors="replace")


def memory_mb(device: torch.device) -> float:
    """Peak accelerator memory of this rank, or its resident CPU memory."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ------------------------------------------------------------------------------- reporting
class Reporter:
    """Rank 0's voice: log lines to stdout and ``train.log``, a progress bar on a terminal."""

    def __init__(self, enabled: bool, run_dir: Path):
        self.enabled = enabled
        self.tty = enabled and sys.stdout.isatty()
        self.bar_shown = False
        self.last_bar = 0.0
        self.file = open(run_dir / "train.log", "a") if enabled else None

    def info(self, message: str) -> None:
        if not self.enabled:
            return
        if self.bar_shown:
            sys.stdout.write("\r\033[K")
            self.bar_shown = False
        print(message, flush=True)
        stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        for line in message.splitlines() or [""]:
            self.file.write(f"{stamp} {line}\n")
        self.file.flush()

    def bar(self, step: int, total: int, text: str) -> None:
        if not self.tty or (time.monotonic() - self.last_bar < 0.1 and step < total):
            return
        width = 24
        done = int(width * step / total)
        sys.stdout.write(f"\r\033[K[{'#' * done}{'.' * (width - done)}] {text}")
        sys.stdout.flush()
        self.bar_shown, self.last_bar = True, time.monotonic()

    def close(self) -> None:
        if self.enabled:
            if self.bar_shown:
                sys.stdout.write("\n")
            self.file.close()


def _duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s" if m else f"{seconds:.1f}s"


def write_loss_curve(run_dir: Path, losses: list[float], val_loss: float | None,
                     title: str) -> str:
    """Write ``loss.csv`` and, when matplotlib is installed, ``loss.png``; say what was written."""
    with open(run_dir / "loss.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss"])
        w.writerows((i + 1, f"{v:.6f}") for i, v in enumerate(losses))
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only, never a window
        import matplotlib.pyplot as plt
    except ImportError:
        return (f"loss curve: {run_dir / 'loss.csv'} (matplotlib is not installed, so no "
                "loss.png; pip install 'twinshard[train]' to get the plot)")
    steps = np.arange(1, len(losses) + 1)
    # A centred moving average shows the trend through the noise without lagging behind it.
    half = max(1, len(losses) // 100)
    padded = np.pad(np.asarray(losses, dtype=float), half, mode="edge")
    smooth = np.convolve(padded, np.ones(2 * half + 1) / (2 * half + 1), mode="valid")
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=1, label="train loss")
    ax.plot(steps, smooth, color="tab:blue", linewidth=2, label="train loss (smoothed)")
    if val_loss is not None and len(losses):
        ax.scatter([len(losses)], [val_loss], color="tab:red", zorder=3, label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "loss.png")
    plt.close(fig)
    return f"loss plot: {run_dir / 'loss.png'} (and {run_dir / 'loss.csv'})"


# ------------------------------------------------------------------------------ the ranks
def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree_on_out(cfg: TrainConfig) -> Path:
    """Under torchrun without --out, rank 0 names the run directory for everyone."""
    choice = [cfg.out]
    if choice[0] is None:
        if dist.get_rank() == 0:
            choice[0] = str(_fresh_run_name())
        dist.broadcast_object_list(choice, src=0)
    return Path(choice[0])


def rank_main(cfg: TrainConfig) -> dict:
    """What every rank runs: set up, maybe resume, train, checkpoint, report."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device()
    run_dir = _agree_on_out(cfg)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    log = Reporter(rank == 0, run_dir)
    try:
        return _train(cfg, rank, world, device, run_dir, log, init_device_mesh(device.type, (world,)))
    finally:
        log.close()


def _train(cfg, rank, world, device, run_dir, log: Reporter, mesh) -> dict:
    corpus = load_corpus(cfg.data, cfg.seq_len)
    windows = Windows(corpus.train, cfg.seq_len, cfg.seed)
    model = build_model(cfg, device, mesh)
    opt, sched = build_optimizer(cfg, model)
    n_params = sum(p.numel() for p in model.parameters())  # DTensor: the global size
    step, samples, losses, resumed = 0, 0, [], None
    if cfg.resume_from:  # before anything is written, so a failed load leaves the run as it was
        step, samples, losses, resumed = _resume(cfg, rank, world, model, opt, sched)
    else:
        seed_rank_rngs(cfg.seed, 0, rank)
    log.info(f"twinshard train: {cfg.impl} fully_shard on {world} rank(s) ({dist.get_backend()}, "
             f"{device.type}); preset {cfg.preset} ({n_params / 1e6:.2f}M parameters); data "
             f"{corpus.name} ({len(corpus.train) / 1e6:.2f}M bytes); run directory {run_dir}")
    if resumed:
        log.info(resumed)
    stop = cfg.stop_at or cfg.steps
    tokens_per_step = cfg.batch_size * cfg.seq_len
    log.info(f"steps {step} -> {stop} of {cfg.steps}; global batch {cfg.batch_size} x "
             f"{cfg.seq_len} tokens ({cfg.batch_size // world // cfg.grad_accum} per micro-batch x "
             f"{cfg.grad_accum} on each rank); lr {cfg.lr:g} (warmup {cfg.warmup}, cosine to "
             f"{cfg.min_lr:g}); {cfg.param_dtype} params"
             + (f", {cfg.reduce_dtype} reduce" if cfg.reduce_dtype else "")
             + (", CPU offload" if cfg.cpu_offload else ""))
    for note in cfg.notes:
        log.info(f"note: {note}")
    manifest_base = {"model": cfg.model, "config": cfg.remembered(),
                     "data_fingerprint": cfg.data_fingerprint, "impl": cfg.impl,
                     "torch": torch.__version__}
    t_start = time.perf_counter()
    train_time, last_ckpt = 0.0, None
    first_step = step
    while step < stop:
        t0 = time.perf_counter()
        lr = sched.get_last_lr()[0]  # the rate this step uses
        local = train_step(model, opt, windows, samples, cfg, rank, world, device)
        sched.step()
        step, samples = step + 1, samples + cfg.batch_size
        loss = global_mean(local)
        if not math.isfinite(loss):
            raise TrainError(f"the loss is {loss} at step {step}; lower --lr or use --clip-norm")
        losses.append(loss)
        train_time += time.perf_counter() - t0
        rate = tokens_per_step * (step - first_step) / train_time
        status = (f"step {step}/{cfg.steps}  loss {loss:.4f}  lr {lr:.2e}  "
                  f"{rate / 1e3:.1f}k tok/s  mem {memory_mb(device):.0f} MB")
        log.bar(step, stop, status)
        if step % cfg.log_every == 0 or step == stop or step == first_step + 1:
            eta = (stop - step) * train_time / (step - first_step)
            log.info(f"{status}  eta {_duration(eta)}")
        if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == stop:
            t_ck = time.perf_counter()
            last_ckpt = ckpt.save(run_dir, step, model, opt, sched, {"step": step, "samples": samples},
                                  {**manifest_base, "samples": samples, "losses": losses}, cfg.keep)
            log.info(f"checkpoint {last_ckpt} ({time.perf_counter() - t_ck:.1f}s)")
    val_loss = None
    if corpus.val is not None and cfg.eval_batches:
        val_loss = evaluate(model, Windows(corpus.val, cfg.seq_len, cfg.seed), cfg, rank, world, device)
    sample = None
    if cfg.sample_length:
        sample = generate(model, b"The ", cfg.sample_length, cfg.seq_len, cfg.seed, device)
    elapsed = time.perf_counter() - t_start
    if rank == 0:
        _summary(cfg, log, run_dir, losses, val_loss, sample, elapsed, first_step, step,
                 train_time, world, last_ckpt, stop)
    return {"step": step, "losses": losses, "val_loss": val_loss, "checkpoint": str(last_ckpt)}


def _resume(cfg, rank, world, model, opt, sched) -> tuple[int, int, list, str]:
    """Load the checkpoint into model, optimizer and scheduler and restore or re-derive the
    RNGs; return (step, samples consumed, loss history, a line for the log)."""
    where = Path(cfg.resume_from)
    manifest = ckpt.validate(where)
    trainer = ckpt.load(where, model, opt, sched)
    if trainer["step"] != manifest["step"] or trainer["samples"] != manifest["samples"]:
        raise ckpt.CheckpointError(f"checkpoint {where} is inconsistent: its DCP data is at step "
                                   f"{trainer['step']}, its manifest at {manifest['step']}")
    if manifest["world_size"] == world:
        ckpt.set_rng_state(ckpt.load_rng(where, rank))
        rng = "per-rank RNG states restored"
    else:
        seed_rank_rngs(cfg.seed, trainer["step"], rank)
        rng = (f"per-rank RNG states cannot be resharded from {manifest['world_size']} to {world} "
               f"ranks: re-derived from (seed {cfg.seed}, step {trainer['step']}, rank)")
    history = list(manifest.get("losses", []))[:trainer["step"]]
    return (trainer["step"], trainer["samples"], history,
            f"resumed {where} ({ckpt.describe(manifest)}) on {world} rank(s); {rng}")


def _summary(cfg, log, run_dir, losses, val_loss, sample, elapsed, first_step, step,
             train_time, world, last_ckpt, stop) -> None:
    k = max(1, min(5, len(losses) // 2))
    head, tail = sum(losses[:k]) / k, sum(losses[-k:]) / k
    rate = cfg.batch_size * cfg.seq_len * (step - first_step) / max(train_time, 1e-9)
    title = (f"twinshard train: {cfg.preset}, {world} rank(s), {cfg.impl}, "
             f"batch {cfg.batch_size}x{cfg.seq_len}")
    curve = write_loss_curve(run_dir, losses, val_loss, title)
    lines = [f"done: steps {first_step} -> {step} in {_duration(elapsed)} on {world} rank(s); "
             f"{rate / 1e3:.1f}k tokens/s",
             f"loss {head:.3f} -> {tail:.3f} (mean of the first and last {k} steps)"
             + (f"; validation loss {val_loss:.3f}" if val_loss is not None else "")
             + f"; a uniform guess over bytes scores {math.log(256):.3f}",
             curve,
             f"checkpoint: {last_ckpt}"]
    if step < cfg.steps:
        lines.append(f"continue with: twinshard train --resume {run_dir}")
    lines.append(f"export: twinshard export {run_dir} model.safetensors")
    if sample is not None:
        lines.append("sample: " + repr(sample))
    log.info("\n".join(lines))


# ------------------------------------------------------------------------------ entry point
_OUR_ERRORS = ("twinshard.train.TrainError", "twinshard.checkpoint.CheckpointError",
               "twinshard.data.DataError")


def _explain_launch_error(e) -> str:
    """Our own errors from a rank as one clean message; anything else in full."""
    for rank in e.ranks:
        text = e.failures[rank]
        if text.startswith(_OUR_ERRORS):
            return text.split("\n\n", 1)[0].split(": ", 1)[1]
        if "exit code -9" in text or "exit code 137" in text:
            return f"rank {rank} was killed (SIGKILL); the last complete checkpoint is intact"
    return str(e)


def _run_torchrun(cfg: TrainConfig) -> int:
    backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=timedelta(seconds=RUN_TIMEOUT))
    try:
        rank_main(cfg)
        return 0
    except (TrainError, ckpt.CheckpointError, DataError) as e:
        if dist.get_rank() == 0:
            print(f"twinshard train: error: {e}", file=sys.stderr)
        return 1
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> int:
    try:
        cfg = resolve(args)
    except (TrainError, ckpt.CheckpointError, DataError) as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"twinshard train: error: {e}", file=sys.stderr)
        return 2
    if _torchrun_env():
        if args.nproc is not None and args.nproc != int(os.environ["WORLD_SIZE"]):
            print(f"twinshard train: --nproc {args.nproc} ignored: torchrun started "
                  f"{os.environ['WORLD_SIZE']} ranks", file=sys.stderr)
        return _run_torchrun(cfg)
    from twinshard.launch import LaunchError, launch
    try:
        launch(rank_main, cfg.nproc, cfg, timeout=RUN_TIMEOUT)
    except LaunchError as e:
        print(f"twinshard train: error: {_explain_launch_error(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\ntwinshard train: interrupted; continue with: twinshard train --resume {cfg.out}",
              file=sys.stderr)
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twinshard train", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
