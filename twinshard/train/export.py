"""Write a training checkpoint as one full state dict file (safetensors) for the plain model.

    twinshard export runs/20250101-120000 model.safetensors     # the run's latest checkpoint
    twinshard export runs/.../checkpoints/step_00000200 model.safetensors

The sharded checkpoint is read in this one process (DCP assembles every parameter from the
shards of however many ranks wrote it), and written with the keys of the unsharded
``twinshard.models.Llama``. The file's metadata holds the model config as JSON, so it loads
without knowing how the run was configured::

    from safetensors import safe_open
    from safetensors.torch import load_file
    from twinshard.models import Llama, LlamaConfig
    with safe_open("model.safetensors", "pt") as f:
        config = LlamaConfig(**json.loads(f.metadata()["twinshard.model_config"]))
    model = Llama(config)
    model.load_state_dict(load_file("model.safetensors"))

Only parameters are exported (no optimizer state). The output is written next to its final
name and renamed into place, so an existing file is never left half-written; it is only
replaced with ``--force``. Every argument is checked before the checkpoint is read (an output
that is a directory, or in a directory that is missing or cannot be written, is refused), the
checkpoint is verified (``verify.find_intact``: a run's damaged latest checkpoint is named and
the one before it exported), and each problem, a full disk included, is one line.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from . import checkpoint as ckpt

CONFIG_KEY = "twinshard.model_config"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoint",
        metavar="CHECKPOINT_DIR",
        help="a run directory (its latest complete checkpoint) or one checkpoint",
    )
    p.add_argument("out", metavar="OUT.safetensors", help="the file to write")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")


def export(checkpoint: Path, out: Path, force: bool = False) -> tuple[Path, dict]:
    """Write ``out``; return (the checkpoint directory used, its manifest)."""
    from safetensors.torch import save_file

    out = Path(out)
    check_output(out, force)
    found = ckpt.find_intact(Path(checkpoint), again="twinshard export {run} " + str(out))
    if found.passed_over:
        print(f"twinshard export: warning: {found.note()}", file=sys.stderr)
    where, manifest = found.checkpoint, found.manifest
    model_config, state, _ = ckpt.load_full_model(where, manifest)
    tensors, seen = {}, {}
    for name, t in state.items():
        t = t.contiguous()
        if t.data_ptr() in seen:  # a tied weight: safetensors stores each buffer once
            t = t.clone()
        seen[t.data_ptr()] = name
        tensors[name] = t
    metadata = {
        CONFIG_KEY: json.dumps(model_config),
        "twinshard.step": str(manifest["step"]),
        "format": "pt",
    }
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    needed = sum(t.nbytes for t in tensors.values())
    try:
        if shutil.disk_usage(out.parent).free < needed:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        save_file(tensors, str(partial), metadata=metadata)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(partial, 0o666 & ~umask)  # safetensors creates it private (0600)
        os.replace(partial, out)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            free = shutil.disk_usage(out.parent).free
            raise ckpt.CheckpointError(
                f"no space left in {out.parent} for {out.name}: it needs about "
                f"{needed / 2**20:.1f} MB, {free / 2**20:.1f} MB are free"
            ) from e
        raise ckpt.CheckpointError(f"cannot write {out}: {e.strerror or e}") from e
    finally:
        if partial.exists():
            partial.unlink()
    return where, manifest


def check_output(out: Path, force: bool) -> None:
    """Refuse an output that cannot or must not be written, before any work is done."""
    if out.is_dir():
        raise ckpt.CheckpointError(
            f"{out} is a directory; name the file to write, e.g. {out / 'model.safetensors'}"
        )
    if out.exists() and not force:
        raise ckpt.CheckpointError(
            f"{out} already exists; pass --force to replace it, or choose another file name"
        )
    if not out.parent.is_dir():
        raise ckpt.CheckpointError(f"cannot write {out}: the directory {out.parent} does not exist")
    try:  # the one sure test of writability, for root and read-only file systems too
        tempfile.TemporaryFile(dir=out.parent).close()
    except OSError as e:
        raise ckpt.CheckpointError(f"cannot write {out}: {e.strerror or e}") from e


def load_exported(path: Path):
    """The plain ``Llama`` with the parameters of an exported file (a convenience for users)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from twinshard.models import Llama, LlamaConfig

    with safe_open(str(path), "pt") as f:
        config = LlamaConfig(**json.loads(f.metadata()[CONFIG_KEY]))
    model = Llama(config)
    model.load_state_dict(load_file(str(path)))
    return model


def run(args: argparse.Namespace) -> int:
    try:
        where, manifest = export(Path(args.checkpoint), Path(args.out), args.force)
    except ckpt.CheckpointError as e:
        print(f"twinshard export: error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.out}: the model of {where} ({ckpt.describe(manifest)}); load it with "
        "twinshard.train.export.load_exported(path), or Llama(config).load_state_dict(...)"
    )
    return 0
