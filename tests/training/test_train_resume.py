"""``twinshard train --resume`` across world sizes and implementations, saves killed halfway,
and torchrun, through the command line (damaged checkpoints: test_train_verify.py).

Each run is a real multi-process run (gloo on CPU) of a small model for a few steps.
Parameters are compared with ``assert_close`` defaults (fp32).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_support import (
    RESUME_STEPS,
    SMALL,
    assert_same_params,
    assert_same_rng,
    expected_rng,
    final_params,
    rng_files,
    run_train,
)

from twinshard.cli import main as cli
from twinshard.train import checkpoint as ckpt


# ------------------------------------------------------ resume across world sizes
@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    assert (
        run_train(
            "--out",
            out,
            "--world",
            2,
            "--steps",
            RESUME_STEPS,
            "--checkpoint-every",
            0,
            "--impls",
            "reference",
        )
        == 0
    )
    return out


def test_resume_at_1_then_3_ranks_matches_an_uninterrupted_run(uninterrupted, tmp_path):
    """2 ranks (optimized, the default) -> 1 rank (torch's fully_shard, 2 micro-batches) -> 3
    ranks (reference): the same parameters as 2 ranks of the reference throughout."""
    out = tmp_path / "run"
    assert (
        run_train(
            "--out",
            out,
            "--world",
            2,
            "--steps",
            RESUME_STEPS,
            "--stop-at",
            2,
            "--checkpoint-every",
            0,
        )
        == 0
    )
    # Options left out come from the checkpoint; --impls and --grad-accum may change.
    assert (
        cli(
            [
                "train",
                "--resume",
                str(out),
                "--world",
                "1",
                "--stop-at",
                "4",
                "--grad-accum",
                "2",
                "--impls",
                "torch",
            ]
        )
        == 0
    )
    assert cli(["train", "--resume", str(out), "--world", "3", "--impls", "reference"]) == 0
    final = ckpt.resolve(out)
    assert final.name == f"step_{RESUME_STEPS:08d}"
    assert ckpt.validate(final)["world_size"] == 3
    assert_same_params(final_params(out), final_params(uninterrupted))
    truth = ckpt.validate(ckpt.resolve(uninterrupted))["losses"]
    torch.testing.assert_close(ckpt.validate(final)["losses"], truth)
    log = (out / "train.log").read_text()
    assert "from 2 to 1 ranks: re-derived from (seed 0, step 2, rank)" in log
    assert "from 1 to 3 ranks: re-derived from (seed 0, step 4, rank)" in log
    # The per-rank RNG states saved at the end are the re-derived ones, rank by rank.
    states = rng_files(final)
    assert len(states) == 3
    for rank, state in enumerate(states):
        assert_same_rng(state, expected_rng(0, 4, rank))


def test_a_save_killed_halfway_leaves_the_last_checkpoint_loadable(
    uninterrupted, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "run"
    monkeypatch.setenv(ckpt.CRASH_ENV, "4")  # rank 0 is SIGKILLed inside the save of step 4
    assert (
        run_train("--out", out, "--world", 2, "--steps", RESUME_STEPS, "--checkpoint-every", 2) == 1
    )
    assert "killed" in capsys.readouterr().err
    monkeypatch.delenv(ckpt.CRASH_ENV)
    partial = out / "checkpoints" / ".partial-step_00000004"
    written = {p.name for p in partial.iterdir()}
    assert "__0_0.distcp" in written and ".metadata" not in written  # really halfway
    assert not (out / "checkpoints" / "step_00000004").exists()
    assert ckpt.resolve(out).name == "step_00000002"
    ckpt.load_full_model(ckpt.resolve(out))  # the previous checkpoint is whole
    # Resuming at the same world size restores each rank's own RNG state and finishes
    # exactly like the run that was never killed.
    assert cli(["train", "--resume", str(out)]) == 0
    assert not partial.exists()
    assert "per-rank RNG states restored" in (out / "train.log").read_text()
    assert_same_params(final_params(out), final_params(uninterrupted))
    truth = rng_files(ckpt.resolve(uninterrupted))
    for actual, expected in zip(rng_files(ckpt.resolve(out)), truth, strict=True):
        assert_same_rng(actual, expected)
    for rank, state in enumerate(truth):  # and those are the ones derived at step 0
        assert_same_rng(state, expected_rng(0, 0, rank))


def test_torchrun_runs_unchanged(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--standalone",
        "-m",
        "twinshard.cli",
        "train",
        *SMALL,
        "--steps",
        "3",
    ]
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    runs = list((tmp_path / "runs").iterdir())  # no --out: rank 0 named one run directory
    assert len(runs) == 1
    manifest = ckpt.validate(ckpt.resolve(runs[0]))
    assert manifest["step"] == 3 and manifest["world_size"] == 2
    assert "on 2 rank(s)" in (runs[0] / "train.log").read_text()
