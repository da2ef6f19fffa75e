"""One run, one writer, and a full disk: a run directory is locked by the run that writes it,
two runs started at once cannot both write it, and a save on a full disk ends in one line that
names the directory and the space needed, with no ``.partial`` save left behind.

The full disk is real where this process may mount a small tmpfs (bytes: the check before the
save refuses; inodes: a file of the save cannot be created), and injected through
``checkpoint.ENOSPC_ENV`` everywhere (the last rank's DCP writer raises ENOSPC).
"""

from __future__ import annotations

import subprocess

import pytest
from train_support import run_train, snapshot, start_train

from twinshard.cli import main as cli
from twinshard.train import checkpoint as ckpt
from twinshard.train import runlock


# ----------------------------------------------------------------------------- the lock
def test_a_second_writer_is_refused_also_on_resume(short_run, tmp_path, capsys):
    starting = tmp_path / "starting"  # a new run that has not written anything yet
    cases = [(short_run, ["--resume", str(short_run), "--steps", "50"]), (starting, [])]
    for run, argv in cases:
        held = runlock.acquire(run)  # as if a run were writing it now
        try:
            before = snapshot(run)
            assert cli(["train", "--out", str(run), *argv]) == 2
            err = capsys.readouterr().err.strip()
            assert f"{run} is being written by another twinshard train (pid " in err, err
            assert "wait for it to end, or choose another --out" in err and "\n" not in err
            assert snapshot(run) == before
        finally:
            held.release()


def test_two_runs_started_at_once_on_one_directory_cannot_both_write(tmp_path):
    out = tmp_path / "run"
    runs = [start_train("--out", out, "--steps", 2, "--checkpoint-every", 0) for _ in range(2)]
    results = [(p.communicate(timeout=300), p.returncode) for p in runs]
    codes = sorted(code for _, code in results)
    assert codes == [0, 2], results
    refused = next(err for (_, err), code in results if code == 2)
    assert "is being written by another twinshard train" in refused or (
        "already holds a training run" in refused
    ), refused
    log = (out / "train.log").read_text()
    assert log.count("fully_shard on 2 rank(s)") == 1  # one run's log, not two interleaved
    assert ckpt.validate(ckpt.resolve(out))["step"] == 2


# ---------------------------------------------------------------------------- full disk
@pytest.fixture
def small_disk(tmp_path):
    """Mount a tmpfs with the given options at a fresh directory; skip where that is not
    allowed (it needs root or CAP_SYS_ADMIN)."""
    mounted = []

    def mount(options: str):
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
            capture_output=True,
            text=True,
        )
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def assert_one_line_full_disk(err: str, run, step: int) -> None:
    lines = [line for line in err.strip().splitlines() if line.startswith("twinshard train")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert (
        f"no space left on the device of {run / 'checkpoints'} for the checkpoint of " in (lines[0])
    )
    assert f"step {step}: it needs about " in lines[0] and " MB, " in lines[0]
    assert f"continue with: twinshard train --resume {run}" in lines[0]
    assert not list((run / "checkpoints").glob(".partial-*"))  # the failed save is gone
    assert ckpt.resolve(run).name == f"step_{step - 1:08d}"
    ckpt.validate(ckpt.resolve(run))  # the previous checkpoint is intact


@pytest.mark.parametrize(
    "options",
    ["size=1500k", "size=10m,nr_inodes=16"],
    ids=["no-room-for-the-bytes", "no-room-for-the-files"],
)
def test_a_full_disk_is_one_line(small_disk, options, capsys):
    """1.5 MB hold one checkpoint of the small model (0.8 MB) but not two; 16 inodes hold the
    run directory and one checkpoint, and leave room for only 3 files of the next."""
    run = small_disk(options) / "run"
    assert run_train("--out", run, "--steps", 3, "--checkpoint-every", 1, "--keep", 1) == 1
    assert_one_line_full_disk(capsys.readouterr().err, run, 2)


def test_a_disk_that_fills_during_the_save_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(ckpt.ENOSPC_ENV, "2")
    run = tmp_path / "run"
    assert run_train("--out", run, "--steps", 3, "--checkpoint-every", 1) == 1
    assert_one_line_full_disk(capsys.readouterr().err, run, 2)


def test_export_to_a_full_disk_is_one_line(short_run, small_disk, capsys):
    out = small_disk("size=64k") / "model.safetensors"  # the small model needs about 0.2 MB
    assert cli(["export", str(short_run), str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert f"no space left in {out.parent} for model.safetensors: it needs about " in err
    assert list(out.parent.iterdir()) == []  # no partial file left behind
