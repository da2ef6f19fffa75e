"""Atomic, reshardable training checkpoints on top of ``torch.distributed.checkpoint`` (DCP).

Layout of a run directory::

    RUN/checkpoints/step_00000200/      a complete checkpoint
        .metadata, __0_0.distcp, ...     DCP: model, optimizer, scheduler, step, data position
        rng/rank00000.pt ...             each rank's RNG states (cannot be resharded, see below)
        manifest.json                    written last: config, world size, file sizes, losses
    RUN/checkpoints/.partial-step_00000300/   a save in progress, or one that was killed

Atomicity. Every rank writes into ``.partial-step_N``; after a barrier rank 0 records the
size of every file in ``manifest.json`` and renames the directory to ``step_N``. A rename
within one directory is atomic, so ``step_N`` is either complete or absent: a run killed
during a save leaves the previous checkpoint as the latest complete one, and the next save
clears the partial directory. Older checkpoints are deleted only after the new one is in
place (``keep`` of them stay).

What is resharded and what is not. Model and optimizer state go through DCP's
``get_state_dict``/``set_state_dict``, so a checkpoint saved by W ranks loads at any other
number of ranks (and into any of the reference, optimized and torch ``fully_shard``). The step,
the data position (samples consumed, independent of the number of ranks) and the scheduler
are plain values. Each rank's RNG state belongs to that rank and has no meaning on another
one, so it is stored per rank and restored only when the world size is unchanged; otherwise
the caller re-derives it from the seed, the step and the rank (``build.seed_rank_rngs``) and
says so in the log.

Validation without a process group. ``validate`` checks the manifest, that every file it
lists exists with its recorded size (a truncated or missing file is caught before any rank
starts) and that DCP's ``.metadata`` can be read. ``load_full_model`` reads the whole model
into plain tensors in one process, for ``twinshard export`` and tests.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import state_dict as dsd
from torch.distributed.checkpoint.api import CheckpointException

FORMAT = "twinshard-checkpoint-1"
MANIFEST = "manifest.json"
CHECKPOINTS = "checkpoints"
PARTIAL_PREFIX = ".partial-"
_STEP_DIR = re.compile(r"^step_(\d+)$")
# Test seam: a save of this step SIGKILLs rank 0 after every rank wrote its shard files and
# before DCP's .metadata is written, exactly as if the job were killed in the middle of a save.
CRASH_ENV = "TWINSHARD_CRASH_DURING_SAVE"


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt or does not fit this run."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


# ------------------------------------------------------------------------------ finding
def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints (``step_N`` with a manifest) under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / MANIFEST).is_file()
    ]
    return [p for _, p in sorted(found)]


def checkpoints_root(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def resolve(path: Path) -> Path:
    """A checkpoint directory from ``path``: itself, or the latest complete one in a run
    directory or a ``checkpoints`` directory. Raises ``CheckpointError`` when there is none."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"{path} does not exist; pass a run directory (the --out of a "
            "training run) or one of its checkpoints/step_N directories"
        )
    if (
        (path / MANIFEST).is_file()
        or _STEP_DIR.match(path.name)
        or path.name.startswith(PARTIAL_PREFIX)
    ):
        return path
    for root in (checkpoints_root(path), path):
        if found := complete_checkpoints(root):
            return found[-1]
    partial = [p.name for p in checkpoints_root(path).glob(PARTIAL_PREFIX + "*")]
    hint = f" (only the incomplete save(s) {', '.join(partial)})" if partial else ""
    raise CheckpointError(
        f"no complete checkpoint in {path}{hint}; train without --resume "
        "to start a run, or pass the directory of a run that saved one"
    )


def run_dir_of(checkpoint: Path) -> Path:
    """The run directory a checkpoint belongs to (``RUN/checkpoints/step_N`` -> ``RUN``)."""
    checkpoint = Path(checkpoint)
    if checkpoint.parent.name == CHECKPOINTS:
        return checkpoint.parent.parent
    return checkpoint.parent


# ---------------------------------------------------------------------------- validation
def read_manifest(checkpoint: Path) -> dict:
    """The manifest of ``checkpoint``, after checking that every file it lists is intact."""
    checkpoint = Path(checkpoint)
    what = f"checkpoint {checkpoint}"
    if checkpoint.name.startswith(PARTIAL_PREFIX) or not (checkpoint / MANIFEST).is_file():
        raise CheckpointError(
            f"{what} is incomplete (no {MANIFEST}; its save was probably "
            "interrupted); resume from the run directory to use the latest "
            "complete checkpoint instead"
        )
    try:
        manifest = json.loads((checkpoint / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"{what} is corrupt: {MANIFEST} cannot be read ({e}); "
            "resume from an earlier checkpoint or start a new run"
        ) from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{what} is not a twinshard training checkpoint (format "
            f"{manifest.get('format') if isinstance(manifest, dict) else None!r}, "
            f"expected {FORMAT!r})"
        )
    for name, size in manifest.get("files", {}).items():
        f = checkpoint / name
        if not f.is_file():
            raise CheckpointError(
                f"{what} is corrupt: file {name} is missing; resume from an "
                "earlier checkpoint (pass its step_N directory) or start anew"
            )
        if f.stat().st_size != size:
            raise CheckpointError(
                f"{what} is corrupt: file {name} has {f.stat().st_size} bytes, "
                f"the save wrote {size}; resume from an earlier checkpoint "
                "(pass its step_N directory) or start anew"
            )
    try:
        FileSystemReader(str(checkpoint)).read_metadata()
    except Exception as e:  # a pickle of DCP's own classes: any failure means unreadable
        raise CheckpointError(
            f"{what} is corrupt: DCP's .metadata cannot be read ({type(e).__name__}: {e})"
        ) from e
    return manifest


def validate(checkpoint: Path) -> dict:
    """``read_manifest`` plus a check that the model entries are complete."""
    manifest = read_manifest(checkpoint)
    for key in ("step", "world_size", "model", "config", "samples"):
        if key not in manifest:
            raise CheckpointError(
                f"checkpoint {checkpoint} is corrupt: its manifest has no '{key}'"
            )
    return manifest


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
    """DCP's file writer with the crash test seam (see ``CRASH_ENV``) in ``finish``."""

    def __init__(self, path: Path, crash: bool):
        super().__init__(str(path))
        self._crash = crash

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


def save(
    run_dir: Path, step: int, model, optimizer, scheduler, trainer: dict, manifest: dict, keep: int
) -> Path:
    """Save a checkpoint of ``step`` atomically (collective: every rank calls it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    root = checkpoints_root(run_dir)
    final = root / step_dir_name(step)
    partial = root / (PARTIAL_PREFIX + step_dir_name(step))
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if final.exists():  # config.resolve refuses runs that would get here
            raise CheckpointError(f"refusing to overwrite the existing checkpoint {final}")
        for stale in root.glob(PARTIAL_PREFIX + "*"):  # killed saves: never complete now
            shutil.rmtree(stale)
        (partial / "rng").mkdir(parents=True)
    dist.barrier()
    crash = rank == 0 and os.environ.get(CRASH_ENV) == str(step)
    dcp.save(
        _app_state(model, optimizer, scheduler, trainer), storage_writer=_Writer(partial, crash)
    )
    torch.save(rng_state(), partial / "rng" / f"rank{rank:05d}.pt")
    dist.barrier()  # every rank's files are written
    if rank == 0:
        files = {
            str(f.relative_to(partial)): f.stat().st_size
            for f in sorted(partial.rglob("*"))
            if f.is_file()
        }
        manifest = {"format": FORMAT, **manifest, "step": step, "world_size": world, "files": files}
        with open(partial / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(partial)
        os.rename(partial, final)  # the commit point
        _fsync_dir(root)
        for old in complete_checkpoints(root)[: -max(1, keep)]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()  # nobody reads or writes the next checkpoint before this one is in place
    return final


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


def load_full_model(checkpoint: Path) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """(model config dict, full state dict of plain CPU tensors, manifest), in this process.

    Needs no process group: DCP reads every shard and assembles the whole tensors.
    """
    from twinshard.models import Llama, LlamaConfig

    checkpoint = Path(checkpoint)
    manifest = validate(checkpoint)
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


def describe(manifest: dict[str, Any]) -> str:
    return (
        f"step {manifest['step']} of {manifest['config'].get('steps')}, saved by "
        f"{manifest['world_size']} rank(s)"
    )
