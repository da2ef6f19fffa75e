"""Train a small Llama-style language model with FSDP, end to end, with checkpoints that survive.

    twinshard train                                  # ~2 min on 2 CPU ranks, built-in corpus
    twinshard train --data book.txt --steps 2000 --model small --world 4
    twinshard train --resume runs/20250101-120000     # continue the latest complete checkpoint
    twinshard train --impls reference                # the readable spec instead of the fast path
    torchrun --nnodes 2 --nproc-per-node 8 -m twinshard.cli train --model 1b ...

This is the entry point: it resolves the command line (``config.resolve``), locks the run
directory (``runlock.claim``), starts the ranks and turns their errors into one line. Local or
``torchrun``: without ``RANK``/``WORLD_SIZE`` in the environment this process starts
``--world`` local ranks with ``twinshard.ranks.launch``, which kills them if this process dies,
passes SIGINT and SIGTERM on to them (they stop after a checkpoint of the step in progress)
and runs the watchdog (``--hang-timeout``); under ``torchrun`` (or any launcher that sets
them) it is one of the ranks, joins the process group itself, runs its part of the watchdog
and ignores ``--world``. Every rank then runs ``loop.rank_main``.

Exit status: 0 done, 2 refused before anything ran (bad flags, data or checkpoint, a run
directory in use), 1 a rank failed or the run stalled, 128 + N stopped by signal N (130 for
SIGINT, 143 for SIGTERM; the checkpoint of the last finished step can be resumed).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from twinshard.ranks import devices, fresh_process, watchdog

from . import checkpoint as ckpt
from .checkpoint import CheckpointError
from .config import TrainConfig, TrainError, resolve, under_torchrun
from .data import DataError
from .flags import add_arguments  # noqa: F401  (the CLI calls add_arguments(parser), run(args))
from .loop import rank_main
from .runlock import claim

RUN_TIMEOUT = 30 * 24 * 3600.0  # launch's deadline; a dead rank is noticed at once anyway
# Errors whose message says all: shown as one line, without a traceback.
OUR_ERRORS = (TrainError, CheckpointError, DataError)
# How a rank's failure text starts for them (launch reports "module.Class: message ...").
_OUR_ERROR_NAMES = tuple(f"{e.__module__}.{e.__qualname__}" for e in OUR_ERRORS)


def _resume_hint(run_dir: Path) -> str:
    if ckpt.complete_checkpoints(ckpt.checkpoints_root(run_dir)):
        return f"continue with: twinshard train --resume {run_dir}"
    return "no checkpoint was saved yet; start the run again"


def _explain_launch_error(e, run_dir: Path) -> str:
    """Our own errors from a rank as one clean message; a stall as its verdict, with every
    rank's stack written to a file in the run directory; anything else in full."""
    from twinshard.ranks.launch import HangError

    if isinstance(e, HangError):
        stacks = run_dir / f"stall-{datetime.now():%Y%m%d-%H%M%S}.txt"
        try:
            stacks.write_text(str(e) + "\n")
            where = f"every rank's stack is in {stacks}"
        except OSError:
            where = f"every rank's stack:\n{e}\n"
        return f"{e.headline}; {where}; {_resume_hint(run_dir)}"
    for rank in e.ranks:
        text = e.failures[rank]
        if text.startswith(_OUR_ERROR_NAMES):
            return text.split("\n\n", 1)[0].split(": ", 1)[1]
        for code, how in ((-9, "killed (SIGKILL)"), (-15, "terminated (SIGTERM)")):
            if f"exit code {code})" in text:
                return f"rank {rank} was {how}; {_resume_hint(run_dir)}"
    return str(e)


def _interrupted(result: dict, run_dir: Path, say: bool = True) -> int:
    """Say how to resume a run that stopped on a signal; its exit status."""
    if say:
        print(
            f"twinshard train: interrupted by {result['interrupted']} after step "
            f"{result['step']}; {_resume_hint(run_dir)}",
            file=sys.stderr,
        )
    return 128 + getattr(signal, result["interrupted"], signal.SIGTERM)


def _join_torchrun_group() -> torch.device:
    """Join the group torchrun set up; return this rank's device. One accelerator per local
    rank with its backend (nccl, xccl, ...) where the machine has one for each, bound to the
    rank with ``device_id``; else gloo on the CPU (``twinshard.ranks.devices``)."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
    backend = devices.accelerator_backend(local_world) or "gloo"
    return devices.join_group(backend, local_rank, timeout=timedelta(seconds=RUN_TIMEOUT))


def _run_torchrun(cfg: TrainConfig) -> NoReturn:
    """Train as one rank of a torchrun job; end with its exit code once its group is
    destroyed, without finalizing the interpreter.

    [Note: a torchrun rank's exit]
    A gloo worker thread drops its reference to a finished collective's tensors only after
    ``wait()`` has returned on the main thread, and dropping a tensor that Python created
    takes the GIL. If the worker asks for it while the interpreter finalizes, Python ends that
    thread inside a C++ destructor and the process aborts ("terminate called without an active
    exception", exit -6) after the run has finished and saved; ``destroy_process_group`` does
    not join those threads once DCP or FSDP is imported (torch keeps the group alive). Sleeping
    first so that a late worker gets the GIL only makes the abort rarer (a loaded machine can
    keep the worker off a core longer than any sleep), and when one rank of a two-node run
    aborts, the other agent waits at torchrun's exit barrier for minutes. So the rank does
    what ``twinshard.ranks.launch``'s ranks do: its output flushed and its log handlers closed, it
    leaves with ``os._exit`` before the interpreter finalizes (``fresh_process.leave``);
    nothing of the run is left to write by then."""
    _join_torchrun_group()
    if cfg.hang_timeout:
        watchdog.start_torchrun(cfg.hang_timeout)
    try:
        result = rank_main(cfg, lock_run_dir=True)
        if result.get("interrupted"):
            code = _interrupted(result, Path(cfg.out), dist.get_rank() == 0)
        else:
            code = 0
    except OUR_ERRORS as e:
        if dist.get_rank() == 0:
            print(f"twinshard train: error: {e}", file=sys.stderr)
        code = 1
    finally:
        dist.destroy_process_group()
    fresh_process.leave(code)  # see [Note: a torchrun rank's exit]


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
                f"twinshard train: --world {args.nproc} ignored: torchrun started "
                f"{os.environ['WORLD_SIZE']} ranks",
                file=sys.stderr,
            )
        return _run_torchrun(cfg)
    from twinshard.ranks.launch import LaunchError, launch

    try:
        lock = claim(cfg)
    except OUR_ERRORS as e:
        print(f"twinshard train: error: {e}", file=sys.stderr)
        return 2
    run_dir = Path(cfg.out)
    try:
        results = launch(
            rank_main,
            cfg.nproc,
            cfg,
            timeout=RUN_TIMEOUT,
            hang_timeout=cfg.hang_timeout or None,
            forward_signals=True,
        )
    except LaunchError as e:
        print(f"twinshard train: error: {_explain_launch_error(e, run_dir)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C: the ranks were stopped at once
        print(f"\ntwinshard train: stopped at once; {_resume_hint(run_dir)}", file=sys.stderr)
        return 130
    finally:
        lock.release()
    if results[0].get("interrupted"):
        return _interrupted(results[0], run_dir)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m twinshard.train``: the same as ``twinshard train``."""
    parser = argparse.ArgumentParser(prog="twinshard train", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
