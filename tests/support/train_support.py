"""What the training tests share: a small model's flags, how to run ``twinshard train``, and
how to compare parameters, files and RNG states. Imported by tests/conftest.py and the
training test modules."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from twinshard.cli import main as cli
from twinshard.train import build
from twinshard.train import checkpoint as ckpt

# A model and batch small enough for a few seconds per run; 12 sequences split over 1, 2 or 3
# ranks and into 2 micro-batches.
SMALL = "--dim 32 --heads 2 --seq 32 --batch-size 12 --sample-length 0 --eval-batches 1".split()
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


# ------------------------------------------------------------- a run as a separate process
def start_train(*argv, **popen) -> subprocess.Popen:
    """``twinshard train`` with the small model, as a process of its own whose stdout is a
    pipe of text lines (stderr too unless ``popen`` says otherwise)."""
    command = [sys.executable, "-m", "twinshard.cli", "train", *SMALL, *map(str, argv)]
    popen.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, **popen)


def read_until(proc: subprocess.Popen, prefix: str, limit: float = 120.0, stream=None) -> list[str]:
    """The lines of ``proc``'s stdout (or ``stream``) up to the first that starts with
    ``prefix`` (the process is killed if that takes over ``limit`` seconds, ending the loop)."""
    timer = threading.Timer(limit, proc.kill)
    timer.start()
    lines = []
    try:
        for line in stream or proc.stdout:
            lines.append(line)
            if line.startswith(prefix):
                return lines
    finally:
        timer.cancel()
    raise AssertionError(f"no line starting with {prefix!r}; got:\n{''.join(lines)[-3000:]}")


def rank_pids(launcher: int) -> list[int]:
    """The ranks that ``twinshard.ranks.launch`` (or ``torchrun``) in process ``launcher`` started, by
    rank (they start in rank order; multiprocessing's resource tracker is not one of them, and
    the ranks of its fork server are, not the server itself)."""
    processes = []  # (parent, start time, pid, command line)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            command = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        processes.append((int(stat[1]), int(stat[19]), int(entry), command))
    servers = {pid for parent, _, pid, command in processes
               if parent == launcher and b"multiprocessing.forkserver" in command}  # fmt: skip
    found = [
        (start, pid)
        for parent, start, pid, command in processes
        if (parent == launcher and pid not in servers and b"resource_tracker" not in command)
        or parent in servers
    ]
    return [pid for _, pid in sorted(found)]


def alive(pid: int) -> bool:
    """A live process (a zombie waiting for its parent to reap it is dead)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(condition, limit: float) -> bool:
    """Poll ``condition`` for up to ``limit`` seconds; its last value."""
    end = time.monotonic() + limit
    while time.monotonic() < end and not condition():
        time.sleep(0.1)
    return condition()
