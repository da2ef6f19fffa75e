"""Finding checkpoints and checking that they are intact, before any of their bytes is loaded.

A complete checkpoint is a ``step_N`` directory with a ``manifest.json`` (``checkpoint.save``
writes it last, then renames the directory into place). The manifest lists every file with its
size and its sha256 checksum. ``verify`` checks, in one process and without a process group:
the manifest itself, that every file it lists is there with its size and checksum, that DCP's
``.metadata`` can be read, and that the tensors it describes are those of the model the
manifest names (a checkpoint of another model is refused even when its files are intact).

Why sha256. It runs at about 1.7 GB/s on one core with the CPU's SHA extensions, faster than
most disks deliver a checkpoint, so verifying costs little beside loading; the save spreads the
hashing over the ranks. A CRC would be 3x faster but only detects accidents, while a sha256
also identifies the bytes, and anyone can check a file by hand with ``sha256sum``.

``find_intact`` picks what to resume or export: the latest complete checkpoint of a run that
verifies. A damaged one is named and passed over for the one before it; when none is left, or
when the damaged checkpoint was named explicitly, it stops with an error that says what works.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader

FORMAT = "twinshard-checkpoint-1"
MANIFEST = "manifest.json"
CHECKPOINTS = "checkpoints"
PARTIAL_PREFIX = ".partial-"
CHECKSUM = "sha256"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_CHUNK = 8 << 20  # bytes hashed per read: bounded memory for files of any size


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt or does not fit this run."""


class CorruptCheckpoint(CheckpointError):
    """A complete checkpoint whose files do not match its manifest."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(checkpoint: Path) -> int | None:
    m = _STEP_DIR.match(Path(checkpoint).name)
    return int(m.group(1)) if m else None


def checkpoints_root(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints (``step_N`` with a manifest) under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [
        (step_of(p), p)
        for p in root.iterdir()
        if step_of(p) is not None and (p / MANIFEST).is_file()
    ]
    return [p for _, p in sorted(found)]


def is_checkpoint_dir(path: Path) -> bool:
    """Whether ``path`` names one checkpoint (complete or not) rather than a run directory."""
    path = Path(path)
    return (
        (path / MANIFEST).is_file()
        or step_of(path) is not None
        or path.name.startswith(PARTIAL_PREFIX)
    )


def resolve(path: Path) -> Path:
    """A checkpoint directory from ``path``: itself, or the latest complete one in a run
    directory or a ``checkpoints`` directory. Raises ``CheckpointError`` when there is none."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"{path} does not exist; pass a run directory (the --out of a "
            "training run) or one of its checkpoints/step_N directories"
        )
    if is_checkpoint_dir(path):
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


# ---------------------------------------------------------------------------- checking
def file_checksum(path: Path) -> str:
    """The sha256 of a file, read in bounded chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(checkpoint: Path) -> dict:
    """The manifest of ``checkpoint`` (no file is checked: see ``verify``)."""
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
        raise CorruptCheckpoint(f"{what} is corrupt: {MANIFEST} cannot be read ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{what} is not a twinshard training checkpoint (format "
            f"{manifest.get('format') if isinstance(manifest, dict) else None!r}, "
            f"expected {FORMAT!r})"
        )
    for key in ("step", "world_size", "model", "config", "samples"):
        if key not in manifest:
            raise CorruptCheckpoint(f"{what} is corrupt: its manifest has no '{key}'")
    return manifest


def verify(checkpoint: Path) -> dict:
    """The manifest of ``checkpoint`` once every file it lists is there, of its size and
    checksum, and DCP's metadata describes the manifest's model. Raises ``CorruptCheckpoint``
    naming the first file that differs."""
    checkpoint = Path(checkpoint)
    manifest = read_manifest(checkpoint)
    what = f"checkpoint {checkpoint} is corrupt"
    sums = manifest.get("checksums", {})
    for name, size in manifest.get("files", {}).items():
        f = checkpoint / name
        if not f.is_file():
            raise CorruptCheckpoint(f"{what}: file {name} is missing")
        if f.stat().st_size != size:
            raise CorruptCheckpoint(
                f"{what}: file {name} has {f.stat().st_size} bytes, the save wrote {size}"
            )
        if name in sums and file_checksum(f) != sums[name]:
            raise CorruptCheckpoint(
                f"{what}: file {name} does not match its {CHECKSUM} checksum (its bytes "
                "changed after the save)"
            )
    try:
        metadata = FileSystemReader(str(checkpoint)).read_metadata()
    except Exception as e:  # a pickle of DCP's own classes: any failure means unreadable
        raise CorruptCheckpoint(
            f"{what}: DCP's .metadata cannot be read ({type(e).__name__}: {e})"
        ) from e
    _check_model(checkpoint, manifest, metadata)
    return manifest


def validate(checkpoint: Path) -> dict:
    """``verify``, under the name the rest of the code has always used."""
    return verify(checkpoint)


def _check_model(checkpoint: Path, manifest: dict, metadata) -> None:
    """Refuse DCP data whose model tensors are not those of the manifest's model."""
    import torch

    from twinshard.models import Llama, LlamaConfig

    try:
        with torch.device("meta"):
            expected = {
                k: tuple(v.shape)
                for k, v in Llama(LlamaConfig(**manifest["model"])).state_dict().items()
            }
    except (TypeError, ValueError) as e:
        raise CorruptCheckpoint(f"checkpoint {checkpoint} is corrupt: its model config {e}") from e
    stored = {
        k.removeprefix("model."): tuple(getattr(v, "size", ()))
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith("model.")
    }
    if stored == expected:
        return
    diff = sorted(set(stored) ^ set(expected)) or [k for k in expected if stored[k] != expected[k]]
    name = diff[0]
    raise CorruptCheckpoint(
        f"checkpoint {checkpoint} holds another model than its manifest says: {name} is "
        f"{stored.get(name, 'absent')} in its data, {expected.get(name, 'absent')} in the "
        f"model of its manifest ({_model_summary(manifest['model'])})"
    )


def _model_summary(model: dict) -> str:
    return ", ".join(f"{k} {model.get(k)}" for k in ("dim", "n_layers", "n_heads"))


# ----------------------------------------------------------------------------- choosing
@dataclass
class Found:
    """The checkpoint to use, its manifest, and the damaged ones passed over (newest first)."""

    checkpoint: Path
    manifest: dict
    passed_over: list[tuple[Path, str]] = field(default_factory=list)

    def note(self) -> str | None:
        if not self.passed_over:
            return None
        named = "; ".join(str(reason) for _, reason in self.passed_over)
        return f"{named}; using {self.checkpoint.name}, the latest intact checkpoint, instead"


def find_intact(path: Path, *, again: str) -> Found:
    """The checkpoint to resume or export from ``path``: itself when it names one (which must
    verify), else the latest complete checkpoint of the run that verifies. ``again``: the
    command with the run directory as ``{run}``, for the advice in errors."""
    path = Path(path)
    checkpoint = resolve(path)
    if is_checkpoint_dir(path):
        try:
            return Found(checkpoint, verify(checkpoint))
        except CorruptCheckpoint as e:
            run = run_dir_of(checkpoint)
            raise CorruptCheckpoint(
                f"{e}; pass the run directory instead ({again.format(run=run)}): it falls "
                "back to the latest intact checkpoint, if there is one"
            ) from e
    candidates = complete_checkpoints(checkpoints_root(path)) or complete_checkpoints(path)
    passed_over = []
    for candidate in reversed(candidates):
        try:
            return Found(candidate, verify(candidate), passed_over)
        except CorruptCheckpoint as e:
            passed_over.append((candidate, str(e)))
    reasons = "; ".join(reason for _, reason in passed_over)
    raise CorruptCheckpoint(
        f"no intact checkpoint in {path}: {reasons}; start a new run without --resume "
        "(or with another --out)"
    )


def describe(manifest: dict[str, Any]) -> str:
    return (
        f"step {manifest['step']} of {manifest['config'].get('steps')}, saved by "
        f"{manifest['world_size']} rank(s)"
    )
