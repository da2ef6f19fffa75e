"""The watchdog's verdict: read every rank's record, decide that the run stalled, name who.

Each rank publishes a record (``twinshard.ranks.watchdog``): how many collectives it has issued, the
last one, whether its Python call to a collective is running (``inside``), its own words from
``progress()``, the host sync it is blocked in (``sync``), whether its collectives return once
queued on a device stream (``queued``), and a heartbeat. ``Detector`` reads them all: when no
rank's record has changed for ``hang_timeout`` seconds the run has stalled, and ``Stall`` names

- the ranks whose heartbeat stopped too (a process stopped with SIGSTOP or a debugger, or
  frozen outside Python): they are the cause;
- on a backend whose collectives return once queued (nccl, xccl, hccl, ...), the ranks that
  issued the fewest collectives. There a call returns as soon as the collective is queued,
  so a hang surfaces later, at the next host sync (``.item()``, a synchronize, a blocking copy
  to the host), and every rank reads as outside any collective: what tells the stalled rank
  apart is that it is behind. The lines say what is known ("issued 4 collectives, the last
  all_reduce #4; blocked in a host sync, Tensor.item"), never that a rank waits in one;
- on a backend whose blocking collectives return when done (gloo, mpi), the ranks outside any
  collective while the others wait in one;
- else, when all wait, the ranks that issued fewer collectives than the others.
"""

from __future__ import annotations

import json
import time

__all__ = ["Detector", "Stall", "publish_interval"]


def publish_interval(hang_timeout: float) -> float:
    """How often a rank publishes its record: a few times per hang timeout, at most 1 s."""
    return min(1.0, max(0.05, hang_timeout / 10))


class Detector:
    """Reads every rank's record; ``check()`` returns a ``Stall`` once none has changed for
    ``hang_timeout`` seconds (measured on this process's clock, so hosts need not agree).
    The clock starts when every rank has reported once."""

    def __init__(self, store, world: int, hang_timeout: float, process_state=None):
        self.store, self.world, self.hang_timeout = store, world, hang_timeout
        self.process_state = process_state or (lambda rank, record: None)
        self.silent_after = max(2.0, 3 * publish_interval(hang_timeout))
        now = time.monotonic()
        self.records: dict[int, dict] = {}
        self.beat_seen = dict.fromkeys(range(world), now)  # when each heartbeat last moved
        self.last_progress = now

    def _read(self) -> dict[int, dict]:
        found = {}
        for rank in range(self.world):
            key = f"rank{rank}"
            if rank in self.records or self.store.check([key]):
                found[rank] = json.loads(self.store.get(key))
        return found

    def check(self) -> Stall | None:
        now, records = time.monotonic(), self._read()
        for rank, rec in records.items():
            old = self.records.get(rank)
            if old is None or (old["events"], old["what"]) != (rec["events"], rec["what"]):
                self.last_progress = now
            if old is None or old["beat"] != rec["beat"]:
                self.beat_seen[rank] = now
        self.records = records
        if len(records) < self.world:  # still starting: the launcher's start-up limit applies
            self.last_progress = now
        stalled_for = now - self.last_progress
        if stalled_for < self.hang_timeout:
            return None
        silent = {r for r in range(self.world) if now - self.beat_seen[r] > self.silent_after}
        return Stall(self, stalled_for, silent)


def describe(rec: dict, silent: bool, state: str | None = None) -> str:
    """One rank's line in a verdict, worded for what its backend lets us know."""
    where = f"{rec['what']}, after {rec['op']}" if rec["op"] else rec["what"]
    if silent:
        how = state or "not responding (stopped, or frozen outside Python)"
        return f"{how}; its last report: {where}"
    if not rec.get("queued"):  # a blocking call returns when the collective is done
        if rec["inside"]:
            return f"waits in {rec['op']} ({rec['what']})"
        return f"running outside any collective ({where})"
    n = rec["issued"]
    issued = f"issued {n} collectives, the last {rec['op']}" if n else "issued no collective"
    if rec["inside"]:  # the call blocks on the host (a barrier, an object collective, setup)
        return f"{issued}; its call to {rec['op']} has not returned ({rec['what']})"
    if rec.get("sync"):
        return f"{issued}; blocked in a host sync, {rec['sync']} ({rec['what']})"
    return f"{issued}; running outside twinshard's collective calls ({rec['what']})"


def _fewest_issued(records: dict[int, dict]) -> set[int]:
    fewest = min(rec["issued"] for rec in records.values())
    return {r for r, rec in records.items() if rec["issued"] == fewest}


def stalled_ranks(records: dict[int, dict], silent: set[int]) -> set[int]:
    """The likely cause of a stall, by the rules of the module docstring."""
    everyone = set(records)
    if silent:
        return set(silent)
    if any(rec.get("queued") for rec in records.values()):
        return _fewest_issued(records)  # every rank, when none is behind
    waiting = {r for r, rec in records.items() if rec["inside"]}
    if waiting and waiting != everyone:
        return everyone - waiting
    return _fewest_issued(records)


def _others_queued(records: dict[int, dict], others: set[int]) -> str:
    """What is known of the ranks not named, when collectives return once queued."""
    device = "their collectives return once queued on the device"
    if not others:
        count = next(iter(records.values()))["issued"]
        return (
            f"; every rank issued {count} collectives and {device}: a collective that cannot "
            "finish on the device, or a host sync on every rank"
        )
    counts = sorted({records[r]["issued"] for r in others})
    ops = sorted({records[r]["op"] for r in others if records[r]["op"]})
    issued = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return (
        f"; the others issued {issued} collectives (the last {', '.join(ops)}), and {device}, "
        "so they hang at their next host sync, not in a collective"
    )


class Stall:
    """A verdict: who stalled, what every rank is doing, and one line that says it."""

    def __init__(self, detector: Detector, seconds: float, silent: set[int]):
        records, world = detector.records, detector.world
        self.lines = {
            r: describe(records[r], r in silent, detector.process_state(r, records[r]))
            for r in range(world)
        }
        self.ranks = sorted(stalled_ranks(records, silent))
        others = set(range(world)) - set(self.ranks)
        if any(rec.get("queued") for rec in records.values()):
            tail = _others_queued(records, others)
        else:
            ops = sorted({records[r]["op"] for r in others if records[r]["inside"]})
            tail = f"; the others wait in {', '.join(ops)}" if ops else ""
        self.headline = (
            f"no rank made progress for {seconds:.0f}s (hang timeout "
            f"{detector.hang_timeout:g}s): rank(s) {', '.join(map(str, self.ranks))} stalled ("
            + "; ".join(f"rank {r}: {self.lines[r]}" for r in self.ranks)
            + ")"
            + tail
        )
