"""A plan recorded at two small depths, continued to the model's depth, where that is exact.

A part of the docs build (``memory_data.py`` calls it). ``continued(records, depths, blocks)``
takes ``runner.record``'s results for one setting at ``DEPTHS`` blocks and returns the memory
at ``blocks`` blocks (parts, peak, its place, parameters), or None where the line is not
known to hold, for the caller to record that setting at full depth instead.

[Note: the model's depth, extrapolated]
``twinshard plan`` records every block: 36 s for one setting of Llama 3 8B (32 blocks), 52 s
with selective checkpointing at 8,192 tokens, on this 2-core machine, and the 70B has 80. A
model's blocks are alike, so every place of a step (a run of the step's memory timeline under
one label) holds bytes that grow by the same amount with each block added, and at a fixed place
so does each part. Two depths give each place its line. The peak's parts are continued only
when (1) the peak is at the same place at both depths, and (2) at the model's depth no other
place's line comes within ``MARGIN`` of the peak's: the places whose lines are drawn are each
label's first two runs and last two (blocks' numbers left out); the runs between are the
middle blocks, alike, whose bytes change in a line along the step and so are highest at one of
those ends. The depths are 4 and 5: at 3 blocks the second block is also the second from last,
and at 2 the 8B's peak is in the output layer's backward with other parts. Why (2) matters:
with selective checkpointing at 2,048 tokens, the 8B's start of backward (every activation
alive) gains 0.43 GiB a block and its end (every gradient shard made) 0.40 GiB; at 4 and 5
blocks the end is the peak, both labelled "backward root", and at 32 blocks they are within
0.1 GiB. Measured: 3 and 4 blocks continued to 32 gave the 8B's parts at full depth to the
byte, without checkpointing at 2,048 tokens and with selective checkpointing at 8,192.
"""

from __future__ import annotations

import re

from twinshard.measure.plan.trace import PARTS

DEPTHS = (4, 5)  # blocks recorded per setting
MARGIN = 0.02  # another place within this fraction of the peak at full depth: record it there
BLOCK = re.compile(r"\bblocks\.(\d+)\b")


def continued(records: list[dict], blocks: int) -> dict | None:
    """``records`` (``runner.record``'s, at ``DEPTHS``) at ``blocks`` blocks, or None."""
    (a, b), (ra, rb) = DEPTHS, records
    where = peak_place(ra["peak_label"], a, rb["peak_label"], b, blocks)
    if where is None or overtaken(ra["timeline"], rb["timeline"], blocks):
        return None
    return {
        "parts": {p: line(ra["parts"][p], rb["parts"][p], blocks) for p in PARTS},
        "peak_bytes": line(ra["peak_bytes"], rb["peak_bytes"], blocks),
        "peak_at": where,
        "params": line(ra["model"]["params"], rb["model"]["params"], blocks),
        "blocks": blocks,
    }


def line(at_a: int, at_b: int, blocks: int) -> int:
    """The value at ``blocks`` on the line through ``at_a`` and ``at_b`` (at ``DEPTHS``)."""
    a, b = DEPTHS
    return at_b + (at_b - at_a) * (blocks - b) // (b - a)  # b - a is 1: whole bytes


def peak_place(label_a: str, a: int, label_b: str, b: int, blocks: int) -> str | None:
    """The peak's place in a model of ``blocks`` blocks, if it is the same at depths ``a`` and
    ``b`` (the same hook of the same block, counted from the first block or from the last),
    else None."""
    ia, ib = BLOCK.search(label_a), BLOCK.search(label_b)
    if ia is None or ib is None:
        return label_b if label_a == label_b else None
    if BLOCK.sub("", label_a) != BLOCK.sub("", label_b):
        return None
    first, last = int(ia.group(1)), int(ib.group(1))
    if first == last:  # from the first block
        return label_b
    if a - first == b - last:  # from the last
        return BLOCK.sub(f"blocks.{blocks - (b - last)}", label_b)
    return None


def places(timeline: list) -> tuple[dict[tuple, int], set[tuple]]:
    """Each label's first two and last two runs in ``timeline`` ((entry, bytes, label)
    samples), named ("first" or "last", the label without its block's number, 0 or 1), with
    the most bytes in each; and the names of the run where the step peaked."""
    runs: list[list] = []
    for _, nbytes, label in timeline:
        if runs and runs[-1][0] == label:
            runs[-1][1] = max(runs[-1][1], nbytes)
        else:
            runs.append([label, nbytes])
    kinds = [BLOCK.sub("blocks.*", label) for label, _ in runs]
    top = max(range(len(runs)), key=lambda i: runs[i][1])
    found, peak = {}, set()
    for i, kind in enumerate(kinds):
        same = [j for j, k in enumerate(kinds) if k == kind]
        order = same.index(i)
        for name in (("first", kind, order), ("last", kind, len(same) - 1 - order)):
            if name[2] < 2:
                found[name] = runs[i][1]
                if i == top:
                    peak.add(name)
    return found, peak


def overtaken(timeline_a: list, timeline_b: list, blocks: int) -> bool:
    """Whether the peak's place at ``DEPTHS`` may not be the peak at ``blocks`` blocks: it is
    not one of the places with a line, or another place's line comes within ``MARGIN`` of it."""
    (at_a, peak_a), (at_b, peak_b) = places(timeline_a), places(timeline_b)
    peak = peak_a & peak_b
    if not peak:
        return True
    top = line(at_a[min(peak)], at_b[min(peak)], blocks)
    others = [
        line(at_a[name], at_b[name], blocks)
        for name in at_a.keys() & at_b.keys()
        if name not in peak_a | peak_b
    ]
    return any(value >= top * (1 - MARGIN) for value in others)
