"""What the training tests share: a small model's flags, how to run ``twinshard train``, and
how to compare parameters, files and RNG states. Imported by tests/conftest.py and the
training test modules."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from twinshard.cli import main as cli
from twinshard.train import build
from twinshard.train import checkpoint as ckpt

# A model and batch small enough for a few seconds per run; 12 sequences split over 1, 2 or 3
# ranks and into 2 micro-batches.
SMALL = (
    "--dim 32 --n-heads 2 --seq-len 32 --batch-size 12 --sample-length 0 --eval-batches 1".split()
)
SMALL += ["--log-every", "1"]
RESUME_STEPS = 6


def run_train(*argv) -> int:
    return cli(["train", *SMALL, *map(str, argv)])


def snapshot(path: Path) -> dict:
    """Every file under ``path`` with its size, modification time and content hash."""
    return {
        str(f.relative_to(path)): (
            f.stat().st_size,
            f.stat().st_mtime_ns,
            hashlib.sha256(f.read_bytes()).hexdigest(),
        )
        for f in sorted(path.rglob("*"))
        if f.is_file()
    }


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    return ckpt.load_full_model(ckpt.resolve(run_dir))[1]


def assert_same_params(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(
            actual[name], expected[name], msg=lambda m, name=name: f"{name}: {m}"
        )


def rng_files(checkpoint: Path) -> list[dict]:
    return [torch.load(f, weights_only=True) for f in sorted((checkpoint / "rng").glob("*.pt"))]


def expected_rng(seed: int, step: int, rank: int) -> dict:
    saved = torch.get_rng_state()
    try:
        build.seed_rank_rngs(seed, step, rank)
        return ckpt.rng_state()
    finally:
        torch.set_rng_state(saved)


def assert_same_rng(actual: dict, expected: dict) -> None:
    assert torch.equal(actual["torch"], expected["torch"])
    assert actual["python"] == expected["python"]
