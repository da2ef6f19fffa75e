"""Atomic, reshardable training checkpoints on top of ``torch.distributed.checkpoint`` (DCP).

Layout of a run directory::

    RUN/checkpoints/step_00000200/      a complete checkpoint
        .metadata, __0_0.distcp, ...     DCP: model, optimizer, scheduler, step, data position
        rng/rank00000.pt ...             each rank's RNG states (cannot be resharded, see below)
        manifest.json                    written last: config, world size, file sizes and
                                         sha256 checksums, losses
    RUN/checkpoints/.partial-step_00000300/   a save in progress, or one that was killed

Atomicity. Every rank writes into ``.partial-step_N``; when all have written, each hashes
its share of the files, and rank 0 records the size and checksum of every file in
``manifest.json`` and renames the directory to ``step_N``. A rename within one directory is
atomic, so ``step_N`` is either complete or absent: a run killed during a save leaves the
previous checkpoint as the latest complete one, and the next save clears the partial
directory. Older checkpoints are deleted only after the new one is in place (``keep`` of
them stay).

Failures are collective. Before writing, rank 0 checks that the disk has room for the
checkpoint (the size of the previous one, or of the tensors to save); a save that fails on any
rank (a full disk, an unwritable directory) is removed on rank 0 and raises the same one-line
``CheckpointError`` on every rank, so that no rank waits for a peer that gave up.

What is resharded and what is not. Model and optimizer state go through DCP's
``get_state_dict``/``set_state_dict``, so a checkpoint saved by W ranks loads at any other
number of ranks (and into any of the reference, optimized and torch ``fully_shard``). The step,
the data position (samples consumed, independent of the number of ranks) and the scheduler
are plain values. Each rank's RNG state belongs to that rank and has no meaning on another
one, so it is stored per rank and restored only when the world size is unchanged; otherwise
the caller re-derives it from the seed, the step and the rank (``build.seed_rank_rngs``) and
says so in the log.

Verification without a process group (``verify.py``, re-exported here): ``validate`` checks
the manifest, every file's size and checksum and DCP's ``.metadata`` before any rank starts.
``load_full_model`` reads the whole model into plain tensors in one process, for
``twinshard export`` and tests.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import state_dict as dsd
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from twinshard.ranks import watchdog

from .verify import (
    CHECKSUM,
    FORMAT,
    MANIFEST,
    PARTIAL_PREFIX,
    CheckpointError,
    CorruptCheckpoint,
    checkpoints_root,
    complete_checkpoints,
    describe,
    file_checksum,
    find_intact,
    read_manifest,
    resolve,
    run_dir_of,
    step_dir_name,
    step_of,
    validate,
)

__all__ = [
    "CheckpointError",
    "CorruptCheckpoint",
    "checkpoints_root",
    "complete_checkpoints",
    "describe",
    "find_intact",
    "load",
    "load_full_model",
    "load_rng",
    "read_manifest",
    "resolve",
    "run_dir_of",
    "save",
    "set_rng_state",
    "step_of",
    "validate",
]

# Test seams. A save of the step in CRASH_ENV SIGKILLs rank 0 after every rank wrote its shard
# files and before DCP's .metadata is written, exactly as if the job were killed in the middle
# of a save; one of the step in ENOSPC_ENV fails on the last rank as a full disk would.
CRASH_ENV = "TWINSHARD_CRASH_DURING_SAVE"
ENOSPC_ENV = "TWINSHARD_ENOSPC_DURING_SAVE"
_MB = 1 << 20


# -------------------------------------------------------------------------------- saving
def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a directory; the rename is still atomic
    finally:
        os.close(fd)


class _Writer(FileSystemWriter):
    """DCP's file writer with the test seams (``CRASH_ENV``, ``ENOSPC_ENV``)."""

    def __init__(self, path: Path, crash: bool, enospc: bool):
        super().__init__(str(path))
        self._crash, self._enospc = crash, enospc

    def write_data(self, plan, planner):
        if self._enospc:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        return super().write_data(plan, planner)

    def finish(self, metadata, results) -> None:
        if self._crash:  # the shard files are on disk, .metadata is not: die right here
            os.kill(os.getpid(), signal.SIGKILL)
        super().finish(metadata, results)


def _app_state(model, optimizer, scheduler, trainer: dict) -> dict:
    msd, osd = dsd.get_state_dict(model, optimizer)
    return {
        "model": msd,
        "optim": osd,
        "scheduler": scheduler.state_dict(),
        "trainer": dict(trainer),
    }


def rng_state() -> dict:
    """This rank's RNG states (torch CPU and accelerator, Python's ``random``)."""
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(int(v) for v in state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _local_bytes(value) -> int:
    """Bytes of this rank's part of every tensor in a (nested) state dict."""
    if isinstance(value, DTensor):
        return value.to_local().nbytes
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, dict):
        return sum(_local_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_local_bytes(v) for v in value)
    return 0


def _space_needed(root: Path, state: dict) -> int:
    """About how many bytes the next checkpoint takes (collective): the previous checkpoint's
    size, or the tensors' when there is none."""
    every = [0] * dist.get_world_size()
    dist.all_gather_object(every, _local_bytes(state))  # objects: right for gloo and NCCL
    total = sum(every)
    previous = complete_checkpoints(root)[-1:]
    if previous:
        try:
            return max(total, sum(read_manifest(previous[0]).get("files", {}).values()))
        except CheckpointError:
            pass
    return total


def _space_error(step: int, root: Path, needed: int, free: int, run_dir: Path) -> str:
    try:
        no_files = os.statvfs(root).f_favail == 0 and free >= needed
    except OSError:
        no_files = False
    left = "are free but no inodes (room for new files) are left" if no_files else "are free"
    return (
        f"no space left on the device of {root} for the checkpoint of step {step}: it needs "
        f"about {needed / _MB:.1f} MB, {free / _MB:.1f} MB {left}; free some space, then "
        f"continue with: twinshard train --resume {run_dir}"
    )


def _write_error(e: BaseException, step: int, root: Path, needed: int, run_dir: Path) -> str:
    """One line for an exception of a failed save (DCP wraps every rank's in its own)."""
    found = [e]
    if isinstance(e, CheckpointException):
        found = [exc for exc, _ in e.failures.values()]
    for exc in found:
        while exc is not None and not isinstance(exc, OSError):
            exc = exc.__cause__ or exc.__context__
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return _space_error(step, root, needed, shutil.disk_usage(root).free, run_dir)
        if isinstance(exc, OSError):
            return f"cannot write the checkpoint of step {step} in {root}: {exc}"
    return f"the checkpoint of step {step} could not be saved: {_cause(e)}"


def _agree(message: str | None, src: int | None = None) -> None:
    """Raise ``CheckpointError`` on every rank if ``message`` (from ``src``, or any rank when
    ``src`` is None) says a step of the save failed. Collective."""
    if src is None:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, message)
        message = next((m for m in every if m), None)
    else:
        box = [message]
        dist.broadcast_object_list(box, src=src)
        message = box[0]
    if message:
        raise CheckpointError(message)


def save(
    run_dir: Path, step: int, model, optimizer, scheduler, trainer: dict, manifest: dict, keep: int
) -> Path:
    """Save a checkpoint of ``step`` atomically (collective: every rank calls it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    watchdog.progress(f"saving the checkpoint of step {step}")
    root = checkpoints_root(run_dir)
    final = root / step_dir_name(step)
    partial = root / (PARTIAL_PREFIX + step_dir_name(step))
    state = _app_state(model, optimizer, scheduler, trainer)
    problem = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if final.exists():  # config.resolve refuses runs that would get here
                raise CheckpointError(f"refusing to overwrite the existing checkpoint {final}")
            for stale in root.glob(PARTIAL_PREFIX + "*"):  # killed saves: never complete now
                shutil.rmtree(stale)
        except (OSError, CheckpointError) as e:
            problem = f"cannot save the checkpoint of step {step} in {root}: {e}"
    _agree(problem, src=0)
    needed = _space_needed(root, state)
    crash = rank == 0 and os.environ.get(CRASH_ENV) == str(step)
    enospc = rank == world - 1 and os.environ.get(ENOSPC_ENV) == str(step)
    try:
        if rank == 0:
            problem = _prepare(partial, step, needed, run_dir)
        _agree(problem, src=0)
        try:
            dcp.save(state, storage_writer=_Writer(partial, crash, enospc))
            torch.save(rng_state(), partial / "rng" / f"rank{rank:05d}.pt")
        except (Exception, CheckpointException) as e:  # DCP's own exception is a BaseException
            problem = _write_error(e, step, root, needed, run_dir)
        _agree(problem)  # also: every rank's files are written
        watchdog.progress(f"hashing the checkpoint of step {step}")
        files = sorted(str(f.relative_to(partial)) for f in partial.rglob("*") if f.is_file())
        mine = {name: file_checksum(partial / name) for name in files[rank::world]}
        every = [None] * world
        dist.all_gather_object(every, mine)
        if rank == 0:
            problem = _commit(partial, final, step, world, manifest, every, keep, needed, run_dir)
        _agree(problem, src=0)  # nobody goes on before the checkpoint is in place
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    return final


def _prepare(partial: Path, step: int, needed: int, run_dir: Path) -> str | None:
    """Rank 0: check the free space and create the save's directory; a message on failure."""
    root = partial.parent
    free = shutil.disk_usage(root).free
    if free < needed:
        return _space_error(step, root, needed, free, run_dir)
    try:
        (partial / "rng").mkdir(parents=True)
    except OSError as e:
        return _write_error(e, step, root, needed, run_dir)
    return None


def _commit(partial, final, step, world, manifest, checksums, keep, needed, run_dir) -> str | None:
    """Rank 0: write the manifest, rename the save into place, prune; a message on failure."""
    root = final.parent
    try:
        files = {
            str(f.relative_to(partial)): f.stat().st_size
            for f in sorted(partial.rglob("*"))
            if f.is_file()
        }
        manifest = {
            "format": FORMAT,
            **manifest,
            "step": step,
            "world_size": world,
            "files": files,
            "checksums": {k: v for part in checksums for k, v in part.items()},
            "checksum": CHECKSUM,
        }
        with open(partial / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(partial)
        os.rename(partial, final)  # the commit point
    except OSError as e:
        return _write_error(e, step, root, needed, run_dir)
    _fsync_dir(root)
    for old in complete_checkpoints(root)[: -max(1, keep)]:
        shutil.rmtree(old, ignore_errors=True)
    return None


# ------------------------------------------------------------------------------- loading
def load(checkpoint: Path, model, optimizer, scheduler) -> dict:
    """Load model, optimizer and scheduler in place (collective); return the trainer state."""
    state = _app_state(model, optimizer, scheduler, {"step": -1, "samples": -1})
    try:
        dcp.load(state, checkpoint_id=str(checkpoint))
    except (Exception, CheckpointException) as e:  # DCP's own exception is a BaseException
        raise CheckpointError(
            f"checkpoint {checkpoint} could not be loaded: DCP says "
            f"{_cause(e)}; resume from an earlier checkpoint (pass its "
            "step_N directory) or start a new run"
        ) from e
    dsd.set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    scheduler.load_state_dict(state["scheduler"])
    return state["trainer"]


def load_rng(checkpoint: Path, rank: int) -> dict:
    path = Path(checkpoint) / "rng" / f"rank{rank:05d}.pt"
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {checkpoint}: the RNG state of rank {rank} "
            f"({path.name}) cannot be read: {e}"
        ) from e


def load_full_model(
    checkpoint: Path, manifest: dict | None = None
) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """(model config dict, full state dict of plain CPU tensors, manifest), in this process.

    Needs no process group: DCP reads every shard and assembles the whole tensors. The
    checkpoint is verified first, unless its verified ``manifest`` is passed.
    """
    from twinshard.models import Llama, LlamaConfig

    checkpoint = Path(checkpoint)
    manifest = manifest or validate(checkpoint)
    with torch.device("meta"):
        shapes = Llama(LlamaConfig(**manifest["model"])).state_dict()
    state = {"model": {k: torch.empty(v.shape, dtype=v.dtype) for k, v in shapes.items()}}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        try:
            dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
        except (Exception, CheckpointException) as e:
            raise CheckpointError(
                f"checkpoint {checkpoint} could not be read: DCP says {_cause(e)}"
            ) from e
    return manifest["model"], state["model"], manifest


def _cause(e: BaseException) -> str:
    """One line saying what went wrong, also for DCP's exception that wraps every rank's."""
    if isinstance(e, CheckpointException):
        e = next(iter(e.failures.values()))[0]  # (exception, traceback) of the first rank
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first.split('. ')[0][:200]}"  # torch's advice after it misleads
