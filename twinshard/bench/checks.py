"""What is wrong with a ``twinshard bench`` command line, in one line, before any work starts.

``problem(args)`` looks at the parsed arguments (after ``cli.resolve`` filled the mode's
defaults; a flag still ``None`` is left to the mode) and returns the first thing wrong, naming
the flag and what it takes, or ``None``. ``cli.run`` prints it as
``twinshard bench: error: ...`` and exits with status 2, as ``twinshard train`` does, instead
of a traceback from the launcher or the model many seconds later.
"""

from __future__ import annotations

import torch

from twinshard import devices, impls
from twinshard.models import PRESETS

from . import simnet
from .config import BASELINES, FAKEACCEL_RUNS

POSITIVE = (
    "world",
    "hsdp",
    "seq",
    "per_rank",
    "layers",
    "dim",
    "heads",
    "vocab",
    "steps",
    "repeat",
)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def parse_reshard(value) -> bool | int:
    """``--reshard-after-forward`` (bench, schedule, plan, the fake-accelerator run): true,
    false or a group size; a ``ValueError`` saying so otherwise."""
    lowered = str(value).lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"--reshard-after-forward takes true, false or an int (a group size), not {value!r}"
        ) from None


def reshard_problem(value, world: int, replicas: int = 1) -> str | None:
    """What is wrong with ``--reshard-after-forward`` ``value`` on this mesh, or None."""
    try:
        parsed = parse_reshard(value)
    except ValueError as error:
        return str(error)
    shard = world // max(replicas, 1)
    if not isinstance(parsed, bool) and (parsed < 1 or shard % parsed):
        return f"--reshard-after-forward {parsed} must divide the shard group's size ({shard})"
    return None


def problem(args) -> str | None:
    """The first thing wrong with ``args`` (see the module docstring), or None."""
    for name in POSITIVE:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            return f"{flag(name)} must be a positive integer, got {value}"
    if args.warmup is not None and args.warmup < 0:
        return f"--warmup must be 0 or more, got {args.warmup}"
    if args.world is not None and args.world % args.hsdp:
        return f"--hsdp {args.hsdp} does not divide --world {args.world}: use a divisor"
    if args.impls is not None:
        wrong = impls.problem(args.impls, "--impls", also=BASELINES)
        if wrong:
            return wrong
        if args.backend == "fakeaccel" and not set(impls.names(args.impls)) - set(BASELINES):
            return FAKEACCEL_RUNS
    if args.world is not None:
        wrong = reshard_problem(args.reshard_after_forward, args.world, args.hsdp)
        if wrong:
            return wrong
    if args.preset is not None and args.preset not in PRESETS:
        return f"--preset {args.preset!r} unknown; use {', '.join(PRESETS)}"
    if args.latency_us is not None and args.latency_us < 0:
        return f"--latency-us must be 0 or more, got {args.latency_us}"
    if args.backend == "simnet" or args.mode == "sweep":
        try:
            simnet.parse_link(args.link)
        except ValueError as error:
            return str(error)
    if args.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda: no CUDA device here; use --device cpu (or --backend fakeaccel)"
    runs_on = devices.backend_device(args.backend or "gloo", 0).type  # the backend's device
    if runs_on != "cpu" and args.device != runs_on:
        return (
            f"--backend {args.backend} runs on {runs_on} only: it needs --device {runs_on}; "
            "on the CPU use gloo, fake or simnet"
        )
    if args.backend == "gloo" and args.world is not None and args.world > 64:
        return f"--world {args.world} gloo processes on one machine: use --backend fake or simnet"
    return _model_problem(args)


def _model_problem(args) -> str | None:
    """The model the flags describe, built as a config: its own complaint, if any."""
    from .cli import config_from

    if args.preset is None:
        return None
    try:
        config_from(args).llama()
    except ValueError as error:
        return f"the model of --preset/--layers/--dim/--heads/--vocab: {error}"
    return None
