"""``benchmarks/plan_published.py``: torchtitan's published runs (``published_runs.py``) are
valid plans, and the comparison's arithmetic, table and misses, on summary rows with known
figures (nothing is recorded)."""

from __future__ import annotations

import pytest
from benchmark_scripts import load

from twinshard.measure.plan import config
from twinshard.measure.plan.profiles import DEVICES

published = load("plan_published")
runs = load("published_runs")


def _published_row(
    tokens_per_s, allocated_gib, expandable_gib, plain_gib, plain_fits=True, expandable_fits=True
):
    """A plan's summary row as ``plan_published.compare`` reads it: whether the step fits each
    device, replayed against its memory, with plain and expandable segments (``*_fits``)."""
    return {
        "time": {"tokens_per_s": tokens_per_s, "mfu": 0.35, "exposed_s": 0.0},
        "memory": {
            "peak_bytes": allocated_gib * 2**30,
            "allocator": {  # active: 1 GiB over allocated, in either mode
                "expandable": {
                    "reserved_peak": expandable_gib * 2**30,
                    "allocated_peak": (allocated_gib + 1) * 2**30,
                },
                "segments": {
                    "reserved_peak": plain_gib * 2**30,
                    "allocated_peak": (allocated_gib + 1) * 2**30,
                },
                "fits": {
                    name: {"fits": plain_fits, "fits_expandable": expandable_fits}
                    for name in DEVICES
                },
            },
            "fits": dict.fromkeys(DEVICES, plain_fits),
        },
        "record_s": 1.0,
    }


def test_published_runs_are_valid_plans_and_compared_as_ratios():
    plans = runs.configs()
    assert len(plans) == len(runs.RUNS) >= 10
    assert all(config.problem(job) is None for job in plans.values())
    assert set(runs.FITTED) <= set(plans)
    name = "llama3.1-8b h100 8 bs2 selective-op"
    # reserved: 1.05 (expandable, this run's mode) and 1.2 (plain) of the published 82.4 GiB
    row = _published_row(2 * 5762.0, 41.2, 86.52, 98.88, plain_fits=False)
    (compared,) = published.compare({name: row})
    assert compared["tps_ratio"] == pytest.approx(2.0)
    assert compared["memory_ratio"] == pytest.approx(0.5)
    assert compared["reserved_ratio"] == pytest.approx(1.05)
    assert compared["fitted"] and compared["mode"] == "expandable"
    assert compared["fits"]  # 86.5 GiB of expandable segments on a 96 GiB device
    row = _published_row(2 * 5762.0, 41.2, 86.52, 98.88, plain_fits=False, expandable_fits=False)
    assert not published.compare({name: row})[0]["fits"]  # the replay, not the peak, decides
    text = published.markdown([compared])
    assert (
        "| 11,524 | 2.00 | 82.4 | 41.2 | 0.50 | 42.2 | 86.5 | 98.9 | 1.05 | yes (expandable, 96) |"
        in text
    )
    assert published.missed([compared]) == []  # within 10%: the expandable figure is compared
    compared["reserved_ratio"] = 0.88
    assert published.missed([compared]) == [f"{name}: reserved 0.880 of the published figure"]


def test_published_out_of_memory_settings_must_be_planned_not_to_fit():
    """torchtitan's pages name settings that ran out of memory; each is planned, in the
    allocator mode its launch script set (plain segments before 2024-10-22), and one the plan
    says fits is a miss."""
    oom = runs.configs(runs=runs.OOM_RUNS)
    assert len(oom) >= 3 and not set(oom) & set(runs.RUNS)
    assert all(config.problem(job) is None for job in oom.values())
    assert runs.configs("405b", runs.PLANNED).keys() == {"llama3.1-405b h100 128 bs1 full"}
    name = "llama2-70b a100 bs2 selective-op"
    assert runs.OOM_RUNS[name][4] == "segments"  # the A100 page predates expandable ones
    # plain segments decide: 78 GiB reserved would fit 80 GiB, but the replay against the
    # device's memory failed a request
    (compared,) = published.compare({name: _published_row(300.0, 70.0, 72.0, 78.0, False)})
    assert compared["published_tps"] is None and compared["tps_ratio"] is None
    assert not compared["fits"] and published.missed([compared]) == []
    text = published.markdown([compared])
    assert f"| {name} | out of memory | 300 | - |" in text and "| no (segments, 80) |" in text
    (compared,) = published.compare({name: _published_row(300.0, 70.0, 72.0, 78.0, True)})
    assert published.missed([compared]) == [
        f"{name}: published out of memory, planned to fit (segments: 78.0 GiB reserved of 80)"
    ]


def test_published_runs_gain_the_variants_column():
    """``published --variants SPEC`` plans the runs that ran again with SPEC and sets them
    beside torch's collectives; a spec no plan can run is refused before any recording."""
    name, other = "llama3.1-8b h100 8 bs2 selective-op", "llama3-8b a100 bs1 selective-op"
    assert runs.configs(name, variants="qwz+qgz:node=8")[name].variants == "qwz+qgz:node=8"
    table = published.compare({n: _published_row(5000.0, 41.2, 50.0, 52.0) for n in (name, other)})
    faster = _published_row(6500.0, 40.0, 49.0, 51.0)
    faster["time"]["exposed_s"] = 0.002
    published.add_variants(table, {name: faster, other: {"error": "x\nboom"}}, "qwz+qgz")
    assert table[0]["variants_ratio"] == pytest.approx(1.3)
    assert "variants_tps" not in table[1] and table[1]["variants_error"] == "boom"
    text = published.variants_markdown(table)
    assert f"| {name} | 5,000 | 6,500 | 1.30x | 0 | 2 |" in text
    assert f"| {other} | failed with the variants: boom |" in text
    assert published.variants_markdown(published.compare({name: faster})) == ""
    with pytest.raises(SystemExit):
        published.main(["--only", "h100 8", "--variants", "qgz:node=3"])
