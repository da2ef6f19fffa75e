"""torchtitan's published FSDP2 runs, as plans' jobs with their published figures.

``RUNS`` holds every run of torchtitan's performance pages that FSDP alone reproduces in shape
and policy, ``OOM_RUNS`` the settings the same pages say ran out of memory, ``FITTED`` the two
runs the device efficiencies were fitted on (``twinshard.measure.plan.profiles``), which are no
evidence. ``configs`` makes them jobs of ``twinshard plan`` with torch's ``fully_shard``.
Which pages and how their policies map onto ``--ac``: docs/benchmarks.md, "Planned against
published runs". Read by ``plan_published.py`` (predicted against published) and
``targets.py`` (the optimized path against torch's on every run).
"""

from __future__ import annotations

TITAN_A100 = "torchtitan docs/performance.md @04133643, 64 A100 80GB"
TITAN_A100_OOM = "torchtitan docs/performance.md @395a5262 (table) and @04133643 (note 1)"
TITAN_405B = "torchtitan docs/performance.md @3faaa1a0, 128 H100 (94GB): 1D OOM"
TITAN_H100 = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, H100 96GB 500 W"
# The caching allocator's mode each source ran with: torchtitan's launch script has set
# ``expandable_segments:True`` since 2024-10-22 (56bc26a8); the A100 page (2024-04) and the 405B
# page (2024-08) are older, so plain segments, PyTorch's default.
HARDWARE = {  # the cluster of each source: device, network, allocator mode
    "a100": (dict(device="a100", network="a100-ib"), "segments"),
    "h100": (dict(device="h100-500w", network="h100-roce"), "expandable"),
    "h100-2024-08": (dict(device="h100-500w", network="h100-roce"), "segments"),
}
SEQ = {"llama3": 8192, "llama2": 4096}
# name, model, local batch, activation checkpointing, ranks, hardware, tokens/s/GPU, GiB
TABLE = [
    ("llama3-8b a100 bs1 selective-layer", "llama3-8b", 1, "layer:2", 64, "a100", 2904, None),
    ("llama3-8b a100 bs1 selective-op", "llama3-8b", 1, "selective", 64, "a100", 2973, None),
    ("llama3-70b a100 bs1 full", "llama3-70b", 1, "block", 64, "a100", 331, None),
    ("llama2-13b a100 bs2 none", "llama2-13b", 2, "none", 64, "a100", 2162, None),
    ("llama2-13b a100 bs2 selective-layer", "llama2-13b", 2, "layer:2", 64, "a100", 1914, None),
    ("llama2-13b a100 bs2 selective-op", "llama2-13b", 2, "selective", 64, "a100", 1904, None),
    ("llama2-70b a100 bs1 selective-op", "llama2-70b", 1, "selective", 64, "a100", 355, None),
    ("llama2-70b a100 bs2 full", "llama2-70b", 2, "block", 64, "a100", 353, None),
    ("llama3.1-8b h100 8 bs2 selective-op", "llama3-8b", 2, "selective", 8, "h100", 5762, 82.4),
    ("llama3.1-8b h100 128 bs2 selective-op", "llama3-8b", 2, "selective", 128, "h100", 5605, 67.0),
]
# Settings the same pages say ran out of memory: name, model, local batch, checkpointing, ranks,
# hardware, source. The 405B page names no batch for its 1D attempt; one sequence per rank with
# every block checkpointed is the least memory FSDP alone can run it with, and the 96 GiB
# profile is more than its 94 GB, so "does not fit" here holds for whatever it tried.
OUT_OF_MEMORY = [
    ("llama2-70b a100 bs2 selective-layer", "llama2-70b", 2, "layer:2", 64, "a100", TITAN_A100_OOM),
    ("llama2-70b a100 bs2 selective-op", "llama2-70b", 2, "selective", 64, "a100", TITAN_A100_OOM),
    ("llama3.1-405b h100 128 bs1 full", "llama3-405b", 1, "block", 128, "h100-2024-08", TITAN_405B),
]
SOURCE = {"a100": TITAN_A100, "h100": TITAN_H100}


def _runs(rows) -> dict:
    """name -> (plan, published tokens/s per GPU (None: out of memory), published memory in GiB
    or None, source, allocator mode), from ``TABLE``'s or ``OUT_OF_MEMORY``'s rows."""
    return {
        name: (
            dict(
                preset=model,
                per_rank=batch,
                ac=ac,
                world=world,
                seq=SEQ[model.split("-")[0]],
                **HARDWARE[hardware][0],
            ),
            tps,
            gib,
            source,
            HARDWARE[hardware][1],
        )
        for name, model, batch, ac, world, hardware, tps, gib, source in rows
    }


RUNS = _runs(row + (SOURCE[row[5]],) for row in TABLE)  # the runs that ran
OOM_RUNS = _runs(row[:6] + (None, None, row[6]) for row in OUT_OF_MEMORY)
PLANNED = {**RUNS, **OOM_RUNS}
FITTED = ("llama3-8b a100 bs1 selective-op", "llama3.1-8b h100 8 bs2 selective-op")


def configs(only: str | None = None, runs: dict = RUNS, variants: str = "") -> dict:
    """The runs of ``runs`` (those whose name contains one of ``only``'s comma-separated words)
    as plans with torch's ``fully_shard`` (and the communication ``variants``, if any)."""
    from twinshard.measure.plan import config

    words = only.split(",") if only else [""]
    return {
        name: config.job(impl="torch", variants=variants, **run[0])
        for name, run in runs.items()
        if any(word in name for word in words)
    }
