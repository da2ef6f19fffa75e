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
replaced with ``--force``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
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
    if out.exists() and not force:
        raise ckpt.CheckpointError(
            f"{out} already exists; pass --force to replace it, or choose another file name"
        )
    if not out.parent.is_dir():
        raise ckpt.CheckpointError(f"cannot write {out}: the directory {out.parent} does not exist")
    where = ckpt.resolve(Path(checkpoint))
    model_config, state, manifest = ckpt.load_full_model(where)
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
    try:
        save_file(tensors, str(partial), metadata=metadata)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(partial, 0o666 & ~umask)  # safetensors creates it private (0600)
        os.replace(partial, out)
    finally:
        if partial.exists():
            partial.unlink()
    return where, manifest


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
