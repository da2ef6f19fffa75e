"""A run's settings: ``TrainConfig``, and ``resolve``, which builds it from the command line.

``resolve`` does every check that can fail before a process group exists, so that bad input
ends with one clear line (a ``TrainError``) and nothing written: the numbers, the batch split
over ranks and micro-batches, the model shape, the data file, the implementation, and on
``--resume`` that the checkpoint is intact and fits this run.

Options left out on ``--resume`` are taken from the checkpoint. Options that fix what the run
is (model shape, data, sequence length, seed, learning-rate schedule) cannot change on resume;
the others (steps, batch size, ranks, precision, ...) can, and the log says what changed.

The run directory is checked here too (``check_output``): a new run never writes into a
directory that holds another run, and a resumed one never overwrites a checkpoint newer than
the one it resumes. ``runlock.claim`` repeats that check under the run's lock. On ``--resume``
of a run directory, the latest checkpoint that verifies is used (``verify.find_intact``); the
corrupt ones passed over are named in the log and set aside by ``runlock.claim``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from twinshard.models import PRESETS, LlamaConfig
from twinshard.ranks import devices
from twinshard.ranks.watchdog import DEFAULT_HANG_TIMEOUT

from . import checkpoint as ckpt
from .data import BUILTIN, DataError, Windows, load_corpus
from .flags import DEFAULT_LR, DEFAULTS, FIXED, flag


class TrainError(ValueError):
    """The run cannot start or continue; the message says what to change."""


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
    variants: str  # communication variants, twinshard.variants.parse's spec ("" for none)
    seed: int
    checkpoint_every: int
    keep: int
    log_every: int
    sample_length: int
    eval_batches: int
    # not part of what a checkpoint remembers:
    nproc: int = 1
    hsdp: bool = False  # a (nodes, ranks per node) mesh: replicate across, shard within
    out: str | None = None
    stop_at: int | None = None
    resume_from: str | None = None  # a complete checkpoint directory, verified
    set_aside: list = field(default_factory=list)  # corrupt checkpoints of this run passed over
    hang_timeout: float = DEFAULT_HANG_TIMEOUT  # seconds without progress; 0: no watchdog
    model: dict = field(default_factory=dict)  # the LlamaConfig fields
    data_fingerprint: str = ""
    notes: list = field(default_factory=list)  # for the log, from the resolution

    def remembered(self) -> dict:
        """The settings a checkpoint stores and a resumed run starts from."""
        return {k: getattr(self, k) for k in DEFAULTS}


def under_torchrun() -> bool:
    """Whether a launcher such as ``torchrun`` started this process as one of the ranks."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _default_nproc() -> int:
    return devices.accelerator_count() or 2  # one rank per GPU, else 2 CPU ranks


def _world_size(cfg: TrainConfig) -> int:
    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else cfg.nproc


def resolve(args: argparse.Namespace) -> TrainConfig:
    """Turn the command line (and a checkpoint, on --resume) into a checked ``TrainConfig``."""
    given = {k: getattr(args, k) for k in DEFAULTS if getattr(args, k, None) is not None}
    if given.get("data", BUILTIN) != BUILTIN:  # a resumed run may start in another directory
        given["data"] = os.path.abspath(given["data"])
    resume_from, manifest, notes, passed_over = _find_resume(args)
    base = dict(DEFAULTS)
    if manifest is not None:
        saved = manifest["config"]
        base.update({k: v for k, v in saved.items() if k in DEFAULTS})
        for k, v in given.items():
            if k in FIXED and saved.get(k) != v:
                raise TrainError(
                    f"{flag(k)} {v} does not match the checkpoint "
                    f"({saved.get(k)}); a resumed run keeps it: leave it out, or "
                    "start a new run (without --resume) to change it"
                )
            if k in saved and saved[k] != v:
                notes.append(f"{flag(k)} changed on resume: {saved[k]} -> {v}")
    values = {**base, **given}
    if values["lr"] is None:
        values["lr"] = DEFAULT_LR[values["preset"]]
    if values["min_lr"] is None:
        values["min_lr"] = values["lr"] / 10
    if values["warmup"] is None:
        values["warmup"] = round(0.05 * values["steps"])
    hang_timeout = getattr(args, "hang_timeout", None)
    cfg = TrainConfig(
        **values,
        nproc=_default_nproc() if args.nproc is None else args.nproc,
        stop_at=args.stop_at,
        hsdp=bool(getattr(args, "hsdp", False)),
        resume_from=str(resume_from) if resume_from else None,
        notes=notes,
        hang_timeout=DEFAULT_HANG_TIMEOUT if hang_timeout is None else hang_timeout,
    )
    _check_numbers(cfg)
    _check_variants(cfg)
    cfg.model = _model_config(cfg)
    try:
        corpus = load_corpus(cfg.data, cfg.seq_len)
        Windows(corpus.train, cfg.seq_len, cfg.seed)  # enough tokens for this --seq
    except DataError as e:
        raise TrainError(str(e)) from e
    cfg.data_fingerprint = corpus.fingerprint
    if manifest is not None:
        _check_fits_checkpoint(cfg, manifest)
    out = _choose_output(args, resume_from)
    if out is not None:
        if resume_from is not None and ckpt.run_dir_of(resume_from).resolve() == out.resolve():
            cfg.set_aside = [str(p) for p in passed_over]  # this run's own corrupt ones
        check_output(out, cfg.resume_from, cfg.set_aside)
        cfg.out = str(out)
    load_impl(cfg.impl)  # raises TrainError when it cannot be imported
    return cfg


def _find_resume(args) -> tuple[Path | None, dict | None, list[str], list[Path]]:
    """(checkpoint, its manifest, notes for the log, corrupt checkpoints passed over)."""
    if args.resume is None:
        return None, None, [], []
    if args.resume:
        where = Path(args.resume)
    elif args.out:
        where = Path(args.out)
    else:
        saved = {
            p: ckpt.complete_checkpoints(ckpt.checkpoints_root(p)) for p in Path("runs").glob("*")
        }
        runs = [p for p, found in saved.items() if found]
        if not runs:
            raise TrainError(
                "--resume without a PATH looks for the newest run under runs/, and "
                "there is none with a checkpoint; pass the run directory: --resume DIR"
            )
        where = max(runs, key=lambda p: saved[p][-1].stat().st_mtime)  # newest checkpoint wins
    try:
        found = ckpt.find_intact(where, again="twinshard train --resume {run}")
    except ckpt.CheckpointError as e:
        raise TrainError(str(e)) from e
    notes = [found.note()] if found.passed_over else []
    return found.checkpoint, found.manifest, notes, [p for p, _ in found.passed_over]


def _check_numbers(cfg: TrainConfig) -> None:
    positive = {
        "nproc": cfg.nproc,
        "steps": cfg.steps,
        "batch_size": cfg.batch_size,
        "grad_accum": cfg.grad_accum,
        "seq_len": cfg.seq_len,
        "keep": cfg.keep,
        "log_every": cfg.log_every,
        "lr": cfg.lr,
    }
    nonneg = {
        "min_lr": cfg.min_lr,
        "warmup": cfg.warmup,
        "weight_decay": cfg.weight_decay,
        "clip_norm": cfg.clip_norm,
        "checkpoint_every": cfg.checkpoint_every,
        "sample_length": cfg.sample_length,
        "eval_batches": cfg.eval_batches,
        "hang_timeout": cfg.hang_timeout,
    }
    for name, v in positive.items():
        if not v > 0 or (isinstance(v, float) and not math.isfinite(v)):
            raise TrainError(f"{flag(name)} must be positive, got {v}")
    for name, v in nonneg.items():
        if not v >= 0 or (isinstance(v, float) and not math.isfinite(v)):
            raise TrainError(f"{flag(name)} must be >= 0, got {v}")
    if cfg.min_lr > cfg.lr:
        raise TrainError(
            f"--min-lr {cfg.min_lr:g} is above --lr {cfg.lr:g}; the cosine decays "
            "from --lr down to --min-lr"
        )
    world = _world_size(cfg)
    split = world * cfg.grad_accum
    if cfg.batch_size % split:
        near = max(split, round(cfg.batch_size / split) * split)
        raise TrainError(
            f"--batch-size {cfg.batch_size} cannot be split evenly over {world} "
            f"rank(s) x {cfg.grad_accum} micro-batch(es); use a multiple of {split}, "
            f"e.g. --batch-size {near}"
        )
    gpus = devices.accelerator_count()
    if not under_torchrun() and gpus and cfg.nproc > gpus:
        raise TrainError(
            f"--world {cfg.nproc} but only {gpus} GPU(s): NCCL needs one GPU per "
            f"rank; use --world {gpus} or fewer"
        )
    if cfg.stop_at is not None and not 0 < cfg.stop_at <= cfg.steps:
        raise TrainError(f"--stop-at {cfg.stop_at} must be between 1 and --steps {cfg.steps}")


def _check_variants(cfg: TrainConfig) -> None:
    """``--variants``: a spec ``twinshard.variants`` reads, whose node size divides the ranks
    each parameter is sharded over (a node's, with ``--hsdp``)."""
    if not cfg.variants:
        return
    from twinshard.variants import problem

    world = _world_size(cfg)
    shard = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if cfg.hsdp else world
    wrong = problem(cfg.variants, shard)
    if wrong:
        raise TrainError(wrong)


def _model_config(cfg: TrainConfig) -> dict:
    for dest in ("dim", "n_layers", "n_heads"):
        if getattr(cfg, dest) is not None and getattr(cfg, dest) < 1:
            raise TrainError(f"{flag(dest)} must be positive, got {getattr(cfg, dest)}")
    preset = PRESETS[cfg.preset]
    overrides = {
        k: v
        for k, v in (("dim", cfg.dim), ("n_layers", cfg.n_layers), ("n_heads", cfg.n_heads))
        if v is not None
    }
    if "n_heads" in overrides and "n_kv_heads" in preset:
        overrides["n_kv_heads"] = None  # a preset's grouping may not divide the new head count
    max_len = max(preset.get("max_seq_len", LlamaConfig.max_seq_len), cfg.seq_len)
    try:
        model = LlamaConfig.preset(cfg.preset, **overrides, max_seq_len=max_len)
    except ValueError as e:
        raise TrainError(f"model: {e}; change --dim / --heads") from e
    if model.vocab_size < 256:
        raise TrainError(
            f"the model's vocabulary ({model.vocab_size}) is smaller than the 256 "
            "byte values the data uses"
        )
    return dataclasses.asdict(model)


def _check_fits_checkpoint(cfg: TrainConfig, manifest: dict) -> None:
    where = f"checkpoint {cfg.resume_from}"
    if manifest["model"] != cfg.model:
        diff = ", ".join(
            f"{k} {manifest['model'].get(k)} vs {v}"
            for k, v in cfg.model.items()
            if manifest["model"].get(k) != v
        )
        raise TrainError(
            f"{where} holds another model (preset {manifest['config'].get('preset')!r}, "
            f"this run asks for {cfg.preset!r}; checkpoint vs this run: {diff}); "
            "leave out --model/--dim/--layers/--heads to continue it, or "
            "start a new run without --resume"
        )
    if manifest.get("data_fingerprint") != cfg.data_fingerprint:
        raise TrainError(
            f"{where} was trained on other data ({manifest['config'].get('data')}, "
            f"{manifest.get('data_fingerprint')}) than --data {cfg.data} "
            f"({cfg.data_fingerprint}); its data position would be meaningless. "
            "Pass the same data, or start a new run without --resume"
        )
    step = manifest["step"]
    if step >= cfg.steps:
        raise TrainError(
            f"{where} is already at step {step} of --steps {cfg.steps}; pass a "
            "larger --steps to train further"
        )
    if cfg.stop_at is not None and cfg.stop_at <= step:
        raise TrainError(f"--stop-at {cfg.stop_at} is not after the checkpoint's step {step}")
    if manifest["world_size"] != _world_size(cfg):
        cfg.notes.append("world size changed on resume: the sharded state is resharded by DCP")


def _choose_output(args, resume_from: Path | None) -> Path | None:
    """The run directory: --out, the resumed run's, a fresh one, or None (torchrun's rank 0
    names it after joining and tells the others)."""
    if args.out:
        return Path(args.out)
    if resume_from is not None:
        return ckpt.run_dir_of(resume_from)
    if under_torchrun():
        return None
    return fresh_run_name()


def check_output(out: Path, resume_from: str | None, set_aside: list) -> None:
    """Refuse to write into ``out`` when that would overwrite another run or a newer checkpoint
    of this one (the corrupt checkpoints in ``set_aside`` do not count)."""
    if out.exists() and not out.is_dir():
        raise TrainError(f"--out {out} exists and is not a directory; choose another --out")
    aside = {Path(p).resolve() for p in set_aside}
    existing = [
        p for p in ckpt.complete_checkpoints(ckpt.checkpoints_root(out)) if p.resolve() not in aside
    ]
    resumed = Path(resume_from) if resume_from else None
    if resumed is not None and ckpt.run_dir_of(resumed).resolve() == out.resolve():
        step = ckpt.read_manifest(resumed)["step"]
        newer = [
            p.name
            for p in existing
            if p.resolve() != resumed.resolve() and (ckpt.step_of(p) or 0) > step
        ]
        if newer:
            raise TrainError(
                f"resuming {resumed} inside its own run would overwrite the newer "
                f"checkpoint(s) {', '.join(newer)}; resume the latest one "
                f"(--resume {out}) or write elsewhere with --out NEW_DIR"
            )
    elif existing or (out / "train.log").exists():
        raise TrainError(
            f"{out} already holds a training run; continue it with --resume {out}, "
            "or choose another --out (nothing was changed)"
        )


def fresh_run_name() -> Path:
    """``runs/<date>-<time>``, with a suffix when that directory exists already."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out, n = Path("runs") / stamp, 1
    while out.exists():
        n += 1
        out = Path("runs") / f"{stamp}-{n}"
    return out


def load_impl(name: str):
    """The implementation module ``--impls`` names (``fully_shard`` is all train needs of it:
    ``twinshard.measure.step.shard`` gives one without policy classes ``twinshard.api``'s);
    ``TrainError`` when it cannot be imported or lacks ``fully_shard``."""
    from twinshard.commandline import impls

    try:
        return impls.load(name, "--impls")
    except impls.ImplError as error:
        raise TrainError(str(error)) from None
