"""``twinshard train`` run as a process of its own, and stopped, stalled or killed by signals.

SIGTERM to the launcher (what a scheduler sends) and SIGINT to every process of the run (what
Ctrl-C does) stop it after a checkpoint of the last finished step, with the command to resume,
and the resumed run ends with the same parameters as one that was never interrupted. A rank
stopped with SIGSTOP is named by the watchdog; a launcher killed with SIGKILL takes its ranks
with it. Every wait is bounded by a subprocess timeout; what is asserted is what was reported.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from train_support import (
    SMALL,
    alive,
    assert_same_params,
    final_params,
    rank_pids,
    read_until,
    run_train,
    start_train,
    wait_until,
)

from twinshard.cli import main as cli
from twinshard.train import checkpoint as ckpt
from twinshard.train import runlock

STEPS = 200  # the schedule: far longer than the tests let a run go
RESUME_AT = 12  # interrupted runs are resumed up to this step and compared there


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    args = ("--out", out, "--steps", STEPS, "--stop-at", RESUME_AT, "--checkpoint-every", 0)
    assert run_train(*args) == 0
    return out


def _kill_all(pids) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    "sig, to_all",
    [(signal.SIGTERM, False), (signal.SIGINT, True)],
    ids=["SIGTERM-to-the-launcher", "SIGINT-to-every-process"],
)
def test_a_signal_stops_after_a_checkpoint_and_the_resume_matches(
    uninterrupted, tmp_path, sig, to_all
):
    out = tmp_path / "run"
    proc = start_train(
        "--out", out, "--steps", STEPS, "--checkpoint-every", 0, start_new_session=True
    )
    read_until(proc, "step 3/")
    if to_all:
        os.killpg(proc.pid, sig)  # the launcher and every rank, as Ctrl-C in a terminal
    else:
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    said = re.search(
        rf"interrupted by {sig.name} after step (\d+); continue with: twinshard train "
        rf"--resume {re.escape(str(out))}",
        err,
    )
    assert said, err
    step = int(said.group(1))
    assert 3 <= step < RESUME_AT
    assert "Traceback" not in err
    latest = ckpt.resolve(out)
    assert latest.name == f"step_{step:08d}"  # the last finished step, checkpointed
    assert ckpt.validate(latest)["step"] == step
    assert (
        f"stop requested ({sig.name}): saving a checkpoint of step {step}"
        in (out / "train.log").read_text()
    )
    assert cli(["train", "--resume", str(out), "--stop-at", str(RESUME_AT)]) == 0
    assert_same_params(final_params(out), final_params(uninterrupted))


def test_a_stopped_rank_is_named_and_the_run_stopped(tmp_path):
    out = tmp_path / "run"
    proc = start_train("--out", out, "--steps", STEPS, "--checkpoint-every", 2, "--hang-timeout", 5)
    read_until(proc, "step 3/")
    ranks = rank_pids(proc.pid)
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGSTOP)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        _kill_all(ranks)
    assert proc.returncode == 1, err
    verdict = next(line for line in err.splitlines() if line.startswith("twinshard train: error"))
    assert "no rank made progress for" in verdict and "(hang timeout 5s)" in verdict
    assert "rank(s) 1 stalled (rank 1: stopped (SIGSTOP, or a debugger)" in verdict
    assert "the others wait in " in verdict
    stall = Path(re.search(r"every rank's stack is in (\S+);", verdict).group(1))
    stacks = stall.read_text()
    for rank in (0, 1):
        section = stacks.split(f"--- rank {rank} ---")[1].split("--- rank")[0]
        assert "twinshard/train/loop.py" in section, section  # a Python stack of training
    assert wait_until(lambda: not any(alive(p) for p in ranks), 30)
    ckpt.validate(ckpt.resolve(out))  # the last complete checkpoint is intact
    assert f"continue with: twinshard train --resume {out}" in verdict


def test_ranks_die_with_a_killed_launcher(tmp_path):
    out = tmp_path / "run"
    proc = start_train("--out", out, "--steps", STEPS, "--checkpoint-every", 2)
    read_until(proc, "step 3/")
    ranks = rank_pids(proc.pid)
    assert len(ranks) == 2 and all(alive(p) for p in ranks)
    proc.kill()
    proc.communicate(timeout=60)
    try:
        assert wait_until(lambda: not any(alive(p) for p in ranks), 30), "orphaned ranks"
    finally:
        _kill_all(ranks)
    ckpt.validate(ckpt.resolve(out))  # a save cut short leaves the last complete one
    runlock.acquire(out).release()  # and nobody holds the run directory any more


def test_a_stopped_rank_under_torchrun_is_named(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--standalone", "-m", "twinshard.cli", "train", *SMALL, "--steps", str(STEPS)]
    command += ["--hang-timeout", "5", "--out", str(tmp_path / "run")]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    ranks = []
    try:
        read_until(proc, "step 3/")
        ranks = rank_pids(proc.pid)
        assert len(ranks) == 2
        os.kill(ranks[1], signal.SIGSTOP)
        verdict = read_until(proc, "twinshard watchdog: no rank made progress", stream=proc.stderr)
    finally:
        _kill_all(ranks)  # torchrun itself would wait 30 s before it kills the stopped rank
        proc.kill()
        proc.communicate(timeout=60)
    line = verdict[-1]
    assert "(hang timeout 5s): rank(s) 1 stalled (rank 1: not responding" in line, line
    assert "the others wait in " in line
