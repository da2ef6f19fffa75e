"""Stopping cleanly on SIGINT or SIGTERM: after the step in progress, with a checkpoint of it.

Ctrl-C sends SIGINT to the launcher and every rank; a cluster scheduler sends SIGTERM to some
or all of them before it kills the job; ``twinshard.ranks.launch`` passes a signal to the launcher on
to the ranks. Whoever gets it, a signal only sets a flag in the rank (``StopRequest``). The
training loop adds that flag to the one collective every step has anyway (the average of the
loss), so all ranks learn at the same step that one of them was asked to stop, save a
checkpoint of that step together and return, and the launcher says how to resume. A second
signal to the launcher stops the ranks at once; the last complete checkpoint stays intact.
"""

from __future__ import annotations

import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def name(signum: int) -> str:
    return signal.Signals(signum).name if signum else "a signal"


class StopRequest:
    """While active (``with StopRequest(announce):``), SIGINT and SIGTERM set ``signum``
    instead of interrupting; ``announce``: say so on stderr (rank 0)."""

    def __init__(self, announce: bool):
        self.announce, self.signum, self.previous = announce, 0, {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handler) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _handler(self, signum, frame) -> None:
        if self.signum:
            return  # the same request again (Ctrl-C reaches the launcher and every rank)
        self.signum = signum
        if self.announce:
            sys.stderr.write(
                f"\ntwinshard train: {name(signum)}: stopping after the current step, with a "
                "checkpoint of it (a second Ctrl-C stops at once)\n"
            )
            sys.stderr.flush()
