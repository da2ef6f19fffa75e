"""Train a small Llama-style language model with FSDP, end to end, with checkpoints that survive.

    twinshard train                                  # ~2 min on 2 CPU ranks, built-in corpus
    twinshard train --data book.txt --steps 2000 --preset small --nproc 4
    twinshard train --resume runs/20250101-120000     # continue the latest complete checkpoint
    twinshard train --impl reference                 # the readable spec instead of the fast path
    torchrun --nnodes 2 --nproc-per-node 8 -m twinshard.cli train --preset 1b ...

This is the entry point: it resolves the command line (``config.resolve``), starts the ranks
and turns their errors into one line. Local or ``torchrun``: without ``RANK``/``WORLD_SIZE``
in the environment this process starts ``--nproc`` local ranks with ``twinshard.launch``;
under ``torchrun`` (or any launcher that sets them) it is one of the ranks, joins the process
group itself and ignores ``--nproc``. Every rank then runs ``loop.rank_main``.

Exit status: 0 done, 2 refused before anything ran (bad flags, data or checkpoint), 1 a rank
failed, 130 interrupted (the latest complete checkpoint can be resumed).
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from .checkpoint import CheckpointError
from .config import TrainConfig, TrainError, resolve, under_torchrun
from .data import DataError
from .flags import add_arguments  # noqa: F401  (the CLI calls add_arguments(parser), run(args))
from .loop import rank_main

RUN_TIMEOUT = 30 * 24 * 3600.0  # launch's deadline; a dead rank is noticed at once anyway
# Errors whose message says all: shown as one line, without a traceback.
OUR_ERRORS = (TrainError, CheckpointError, DataError)
# How a rank's failure text starts for them (launch reports "module.Class: message ...").
_OUR_ERROR_NAMES = tuple(f"{e.__module__}.{e.__qualname__}" for e in OUR_ERRORS)


def _explain_launch_error(e) -> str:
    """Our own errors from a rank as one clean message; anything else in full."""
    for rank in e.ranks:
        text = e.failures[rank]
        if text.startswith(_OUR_ERROR_NAMES):
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
    except OUR_ERRORS as e:
        if dist.get_rank() == 0:
            print(f"twinshard train: error: {e}", file=sys.stderr)
        return 1
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> int:
    """Run ``twinshard train`` with parsed flags; return the exit status."""
    if getattr(args, "debug", False):  # the collective guard's debug mode, in every rank
        os.environ["TWINSHARD_DEBUG"] = "1"
    try:
        cfg = resolve(args)
    except OUR_ERRORS as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"twinshard train: error: {e}", file=sys.stderr)
        return 2
    if under_torchrun():
        if args.nproc is not None and args.nproc != int(os.environ["WORLD_SIZE"]):
            print(
                f"twinshard train: --nproc {args.nproc} ignored: torchrun started "
                f"{os.environ['WORLD_SIZE']} ranks",
                file=sys.stderr,
            )
        return _run_torchrun(cfg)
    from twinshard.launch import LaunchError, launch

    try:
        launch(rank_main, cfg.nproc, cfg, timeout=RUN_TIMEOUT)
    except LaunchError as e:
        print(f"twinshard train: error: {_explain_launch_error(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            f"\ntwinshard train: interrupted; continue with: twinshard train --resume {cfg.out}",
            file=sys.stderr,
        )
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m twinshard.train``: the same as ``twinshard train``."""
    parser = argparse.ArgumentParser(prog="twinshard train", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
