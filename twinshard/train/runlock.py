"""One run, one writer: a run directory is locked by the run that writes it.

``claim(cfg)`` takes an exclusive ``flock`` on ``RUN/.lock`` without waiting, before any rank
starts, and only then repeats the checks of ``config.check_output`` that another run could
have invalidated since (two runs started at the same moment with the same ``--out`` both pass
them before either has written anything; under the lock only one can). A second writer, with or
without ``--resume``, gets a ``TrainError`` naming the holder (pid, host, command line, which
the holder writes into the file). The kernel releases a ``flock`` when its holder dies, however
it dies, so a lock is never stale; the ranks die with the launcher that holds it
(``twinshard.ranks.launch``), so nothing writes after the lock is gone. Under ``torchrun`` rank 0
holds it.

Under the lock, the corrupt checkpoints that ``--resume`` passed over are set aside as
``checkpoints/corrupt-step_N`` (kept for inspection, never resumed or pruned), so that the run
can save those steps again.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import sys
from datetime import datetime
from pathlib import Path

from .config import TrainConfig, TrainError, check_output

LOCK = ".lock"


class RunLock:
    """An exclusive lock on a run directory, held until ``release`` or this process ends."""

    def __init__(self, run_dir: Path, fd: int):
        self.run_dir, self.fd = run_dir, fd

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing drops the flock
            self.fd = -1


def acquire(run_dir: Path) -> RunLock:
    """Lock ``run_dir`` (created if needed) or raise ``TrainError`` saying who holds it."""
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise TrainError(
            f"cannot write the run directory {run_dir}: {e.strerror or e}; choose another --out"
        ) from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if e.errno not in (errno.EAGAIN, errno.EACCES):
            raise TrainError(f"cannot lock the run directory {run_dir}: {e.strerror}") from e
        raise TrainError(
            f"{run_dir} is being written by another twinshard train ({holder}); wait for it "
            "to end, or choose another --out"
        ) from None
    stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    who = f"pid {os.getpid()} on {socket.gethostname()} since {stamp}: {' '.join(sys.argv)}"
    os.ftruncate(fd, 0)
    os.pwrite(fd, who.encode() + b"\n", 0)
    return RunLock(run_dir, fd)


def claim(cfg: TrainConfig) -> RunLock:
    """Lock the run directory, check it again under the lock, set aside corrupt checkpoints."""
    lock = acquire(Path(cfg.out))
    try:
        check_output(Path(cfg.out), cfg.resume_from, cfg.set_aside)
        for path in map(Path, cfg.set_aside):
            target, n = path.with_name(f"corrupt-{path.name}"), 1
            while target.exists():
                n += 1
                target = path.with_name(f"corrupt-{path.name}-{n}")
            path.rename(target)
            cfg.notes.append(f"the corrupt {path.name} was moved to {target} (kept, not resumed)")
    except (TrainError, OSError) as e:
        lock.release()
        if isinstance(e, OSError):
            raise TrainError(f"cannot set aside a corrupt checkpoint: {e}") from e
        raise
    return lock
