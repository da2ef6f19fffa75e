"""What rank 0 tells the user: log lines, a progress bar, the loss curve and the summary.

``Reporter`` prints each line and appends it, time-stamped, to ``train.log`` in the run
directory; on a terminal it also keeps a one-line progress bar under the last log line. At the
end, ``write_loss_curve`` writes ``loss.csv`` (and ``loss.png`` when matplotlib is installed)
and ``log_summary`` says how the loss moved, where the checkpoint and plot are, and what to run
next. Every other rank gets a silent ``Reporter``, so the loop logs without asking which rank
it is. ``memory_mb`` is the memory figure of the progress line.
"""

from __future__ import annotations

import csv
import math
import os
import sys
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

from .config import TrainConfig


def memory_mb(device: torch.device) -> float:
    """Peak accelerator memory of this rank, or its resident CPU memory."""
    if device.type != "cpu":
        return torch.get_device_module(device.type).max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Reporter:
    """Rank 0's voice: log lines to stdout and ``train.log``, a progress bar on a terminal."""

    def __init__(self, enabled: bool, run_dir: Path):
        self.enabled = enabled
        self.tty = enabled and sys.stdout.isatty()
        self.bar_shown = False
        self.last_bar = 0.0
        self.file = open(run_dir / "train.log", "a") if enabled else None

    def info(self, message: str) -> None:
        if not self.enabled:
            return
        if self.bar_shown:
            sys.stdout.write("\r\033[K")
            self.bar_shown = False
        print(message, flush=True)
        stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        for line in message.splitlines() or [""]:
            self.file.write(f"{stamp} {line}\n")
        self.file.flush()

    def bar(self, step: int, total: int, text: str) -> None:
        if not self.tty or (time.monotonic() - self.last_bar < 0.1 and step < total):
            return
        width = 24
        done = int(width * step / total)
        sys.stdout.write(f"\r\033[K[{'#' * done}{'.' * (width - done)}] {text}")
        sys.stdout.flush()
        self.bar_shown, self.last_bar = True, time.monotonic()

    def close(self) -> None:
        if self.enabled:
            if self.bar_shown:
                sys.stdout.write("\n")
            self.file.close()


def duration(seconds: float) -> str:
    """``42.0s`` or ``3m05s``."""
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s" if m else f"{seconds:.1f}s"


def write_loss_curve(run_dir: Path, losses: list[float], val_loss: float | None, title: str) -> str:
    """Write ``loss.csv`` and, when matplotlib is installed, ``loss.png``; say what was written."""
    with open(run_dir / "loss.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss"])
        w.writerows((i + 1, f"{v:.6f}") for i, v in enumerate(losses))
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, never a window
        import matplotlib.pyplot as plt
    except ImportError:
        return (
            f"loss curve: {run_dir / 'loss.csv'} (matplotlib is not installed, so no "
            "loss.png; pip install 'twinshard[train]' to get the plot)"
        )
    steps = np.arange(1, len(losses) + 1)
    # A centred moving average shows the trend through the noise without lagging behind it.
    half = max(1, len(losses) // 100)
    padded = np.pad(np.asarray(losses, dtype=float), half, mode="edge")
    smooth = np.convolve(padded, np.ones(2 * half + 1) / (2 * half + 1), mode="valid")
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=1, label="train loss")
    ax.plot(steps, smooth, color="tab:blue", linewidth=2, label="train loss (smoothed)")
    if val_loss is not None and len(losses):
        ax.scatter([len(losses)], [val_loss], color="tab:red", zorder=3, label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "loss.png")
    plt.close(fig)
    return f"loss plot: {run_dir / 'loss.png'} (and {run_dir / 'loss.csv'})"


def log_summary(
    cfg: TrainConfig,
    log: Reporter,
    run_dir: Path,
    losses: list[float],
    val_loss: float | None,
    sample: str | None,
    elapsed: float,
    first_step: int,
    step: int,
    train_time: float,
    world: int,
    last_ckpt: Path | None,
) -> None:
    """Write the loss curve and log the closing lines of a run (rank 0)."""
    k = max(1, min(5, len(losses) // 2))
    head, tail = sum(losses[:k]) / k, sum(losses[-k:]) / k
    rate = cfg.batch_size * cfg.seq_len * (step - first_step) / max(train_time, 1e-9)
    title = (
        f"twinshard train: {cfg.preset}, {world} rank(s), {cfg.impl}, "
        f"batch {cfg.batch_size}x{cfg.seq_len}"
    )
    curve = write_loss_curve(run_dir, losses, val_loss, title)
    lines = [
        f"done: steps {first_step} -> {step} in {duration(elapsed)} on {world} rank(s); "
        f"{rate / 1e3:.1f}k tokens/s",
        f"loss {head:.3f} -> {tail:.3f} (mean of the first and last {k} steps)"
        + (f"; validation loss {val_loss:.3f}" if val_loss is not None else "")
        + f"; a uniform guess over bytes scores {math.log(256):.3f}",
        curve,
        f"checkpoint: {last_ckpt}",
    ]
    if step < cfg.steps:
        lines.append(f"continue with: twinshard train --resume {run_dir}")
    lines.append(f"export: twinshard export {run_dir} model.safetensors")
    if sample is not None:
        lines.append("sample: " + repr(sample))
    log.info("\n".join(lines))
