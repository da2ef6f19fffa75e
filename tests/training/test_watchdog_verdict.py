"""The watchdog's verdict from synthetic records (issue 23, hazard 8): on a backend whose
collectives return once queued (nccl), a hang surfaces at a host sync and every rank reads as
outside any collective; the rank that issued the fewest is the stalled one, and no line may
claim that a rank waits in a collective. On gloo the verdict is what it was.

The records are what each rank's publisher writes (``watchdog.snapshot``), put straight into
a store; the detector reads them as it does in a run.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed as dist

from twinshard.ranks import watchdog


class DictStore:
    """The three store calls the detector makes."""

    def __init__(self, records: list[dict]):
        self.values = {f"rank{r}": json.dumps(rec).encode() for r, rec in enumerate(records)}

    def check(self, keys):
        return all(k in self.values for k in keys)

    def get(self, key):
        return self.values[key]


def record(issued: int, op: str, *, queued: bool, inside=False, sync="", what="step 3") -> dict:
    return dict(
        events=7, issued=issued, inside=inside, op=op, what=what, sync=sync, queued=queued, beat=1
    )


def verdict(records: list[dict]):
    """The stall the detector reports once nothing has changed for its (short) timeout."""
    detector = watchdog.Detector(DictStore(records), len(records), hang_timeout=0.02)
    assert detector.check() is None  # the first reading starts the clock
    time.sleep(0.03)
    stall = detector.check()
    assert stall is not None
    return stall


def test_queued_backend_names_the_rank_that_issued_fewer():
    stall = verdict(
        [
            record(5, "all_gather_into_tensor #5", queued=True, sync="Tensor.item"),
            record(5, "all_gather_into_tensor #5", queued=True),
            record(4, "all_gather_into_tensor #4", queued=True),
        ]
    )
    assert stall.ranks == [2]
    assert (
        "rank 2: issued 4 collectives, the last all_gather_into_tensor #4; running outside "
        "twinshard's collective calls (step 3)" in stall.headline
    )
    assert "the others issued 5 collectives" in stall.headline
    assert "blocked in a host sync, Tensor.item" in stall.lines[0]
    for text in [stall.headline, *stall.lines.values()]:
        assert "waits in" not in text and "wait in" not in text, text


def test_queued_backend_does_not_blame_a_rank_that_is_ahead():
    # Rank 0's barrier blocks on the host (nccl synchronizes inside it); rank 1 is past the
    # same barrier; rank 2 never got there. On gloo, "outside" would point at ranks 1 and 2.
    stall = verdict(
        [
            record(6, "barrier #6", queued=True, inside=True),
            record(6, "barrier #6", queued=True),
            record(5, "all_reduce #5", queued=True),
        ]
    )
    assert stall.ranks == [2]
    assert "its call to barrier #6 has not returned" in stall.lines[0]


def test_queued_backend_with_every_rank_level_names_them_all():
    stall = verdict([record(3, "all_reduce #3", queued=True, sync="torch.cuda.synchronize")] * 2)
    assert stall.ranks == [0, 1]
    assert "every rank issued 3 collectives" in stall.headline
    assert "blocked in a host sync, torch.cuda.synchronize" in stall.lines[1]


def test_blocking_backend_verdict_is_unchanged():
    stall = verdict(
        [
            record(6, "barrier #6", queued=False, inside=True),
            record(5, "all_reduce #5", queued=False),
        ]
    )
    assert stall.ranks == [1]
    assert "rank 1: running outside any collective (step 3, after all_reduce #5)" in stall.headline
    assert stall.headline.endswith("; the others wait in barrier #6")
    assert stall.lines[0] == "waits in barrier #6 (step 3)"


# ------------------------------------------------------------------ what a rank publishes
@pytest.fixture
def sync_hooks():
    yield watchdog.install_sync_hooks
    watchdog.remove_sync_hooks()


def test_a_host_sync_is_named_while_it_runs(monkeypatch, sync_hooks):
    seen = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: seen.append(watchdog.snapshot(0)))
    sync_hooks()
    torch.cuda.synchronize()
    assert seen[0]["sync"] == "torch.cuda.synchronize"
    assert watchdog.snapshot(0)["sync"] == ""  # over once it returns
    assert torch.tensor(2.5).item() == 2.5  # Tensor.item still answers through its wrapper
    assert hasattr(torch.Tensor.item, "__twinshard_watched__")


def test_host_sync_hooks_come_off(sync_hooks):
    sync_hooks()
    watchdog.remove_sync_hooks()
    assert "item" not in vars(torch.Tensor)  # inherited from TensorBase again
    assert not hasattr(torch.cuda.synchronize, "__twinshard_watched__")


def test_snapshot_says_whether_collectives_return_when_queued():
    assert watchdog.snapshot(1)["queued"] is False  # no group
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        snap = watchdog.snapshot(2)
    finally:
        dist.destroy_process_group()
    assert snap["queued"] is False and snap["beat"] == 2  # gloo on the CPU: done on return
