"""A progress bar for long runs, on stderr, without dependencies."""

from __future__ import annotations

import sys
import time


class Progress:
    """``Progress(total)``; ``advance(what)`` after each unit of work; ``close()`` at the end.

    On a terminal the bar redraws in place; elsewhere (a log file, CI) it prints one line per
    unit, so the log shows what ran and how long it took."""

    def __init__(self, total: int, label: str = "bench", stream=None, enabled: bool = True):
        self.total, self.done, self.label = total, 0, label
        self.stream = stream or sys.stderr
        self.enabled = enabled and total > 0
        self.start = time.monotonic()
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def line(self, what: str) -> str:
        width = 24
        filled = int(width * self.done / self.total)
        elapsed = time.monotonic() - self.start
        eta = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        bar = "#" * filled + "." * (width - filled)
        return (
            f"{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.0f}s "
            f"(~{eta:.0f}s left) {what}"
        )

    def advance(self, what: str = "") -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r\033[K" + self.line(what))
            if self.done == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(self.line(what) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty and self.done < self.total:
            self.stream.write("\n")
            self.stream.flush()
