"""``twinshard plan --search`` (``twinshard/measure/plan/search.py``): the settings it tries,
the straight line from two small depths to the model's, the ranking by tokens per second among
the settings that fit by reserved bytes, and why each other one lost. A stand-in for the
recording gives each job a step and a reserved peak that follow from its fields, so the answer
is known; the command itself runs on the tiny model at the end."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from twinshard.cli import main
from twinshard.measure.plan import config, search
from twinshard.measure.units import GiB

BASE = config.job(preset="llama3-8b", world=16, seq=1024, device="h100", impl="torch")


def stand_in(jobs, progress, ideal):
    """Rows as a plan would give them: per block, a step of 4 ms plus per_rank * 10 ms (12 ms
    with checkpointing), 2 ms less with parameters kept after forward, and reserved memory of
    per_rank GiB (a quarter of it with block checkpointing); 1 GiB and 5 ms for the rest."""
    assert ideal is False
    rows = []
    for job in jobs:
        blocks = job.model["n_layers"]
        per_block = 0.004 + job.per_rank * (0.010 if job.ac == "none" else 0.012)
        per_block -= 0.002 if job.reshard_after_forward is False else 0
        gib = job.per_rank * (0.25 if job.ac == "block" else 1.0)
        step = 0.005 + blocks * per_block
        reserved = (1 + blocks * gib) * GiB
        rows.append({"time": {"step_s": step}, "memory": {"reserved_bytes": reserved}})
    return rows


def test_the_settings_cover_checkpointing_batch_resharding_and_one_replica_per_node():
    jobs = search.settings(BASE)
    assert len(jobs) == 4 * 3 * 2 * 2 == len({search.describe(j) for j in jobs})
    assert {j.replicas for j in jobs} == {1, 2}  # 16 ranks: two nodes of 8
    assert len(search.settings(config.job(world=8))) == 24  # one node: FSDP only


def test_the_winner_is_the_fastest_that_fits_and_the_others_say_why():
    found = search.search(BASE, 32, stand_in, progress=False)
    ranked, best = found["ranked"], found["best"]
    # 80 GiB: per_rank 4 fits only with block checkpointing (1 + 32 GiB), 2 without (65 GiB);
    # the fastest: no checkpointing, 2 sequences, parameters kept (2 * 1024 / (0.005 + 32 *
    # 0.022) = 2,888 tokens/s; 1 sequence makes 2,632, 4 under block checkpointing 2,552);
    # FSDP and HSDP tie here, and the first tried (FSDP) stays first
    assert search.describe(best["job"]) == "ac none, 2 x 1024 tokens, keep after forward, FSDP"
    assert best["tokens_per_s"] == pytest.approx(2 * 1024 / (0.005 + 32 * 0.022))
    assert best["reserved_bytes"] == pytest.approx(65 * GiB)
    assert found["confirmed"]["time"]["step_s"] == pytest.approx(0.005 + 32 * 0.022)
    unfit = [r for r in ranked if not r["fits"]]
    assert unfit and all(r["why"].startswith("does not fit: ") for r in unfit)
    assert all(r["reserved_bytes"] > 80 * GiB for r in unfit)
    slower = [r for r in ranked if r["fits"] and r is not best]
    assert all(r["tokens_per_s"] <= best["tokens_per_s"] for r in slower)
    recorded = [r for r in slower if "row" in r]  # the other two of the three recorded in full
    assert len(recorded) == search.CONFIRM - 1
    assert all(r["why"].startswith("slower: ") for r in recorded)
    assert all(r["why"].startswith("guessed ") for r in slower if "row" not in r)
    assert ranked.index(best) == 0 and best["why"] == "fastest that fits"


def test_the_guesses_are_recorded_in_full_and_the_recordings_decide():
    """Kept parameters cost 0.5 s more at full depth than the line from two small depths says:
    the best guess (no checkpointing, 2 sequences, kept) loses to the next one recorded in full
    (resharded)."""

    def bent(jobs, progress, ideal):
        rows = stand_in(jobs, progress, ideal)
        for job, row in zip(jobs, rows):
            if job.model["n_layers"] == 32 and job.reshard_after_forward is False:
                row["time"]["step_s"] += 0.5
        return rows

    eight = replace(BASE, world=8)  # one node: no HSDP twins among the guesses
    found = search.search(eight, 32, bent, progress=False)
    best = found["best"]
    assert search.describe(best["job"]) == "ac none, 2 x 1024 tokens, reshard after forward, FSDP"
    assert best["tokens_per_s"] == pytest.approx(2 * 1024 / (0.005 + 32 * 0.024))
    first_guess = next(r for r in found["ranked"] if r.get("guess") and r is not best
                       and r["guess"]["tokens_per_s"] > best["tokens_per_s"])  # fmt: skip
    assert search.describe(first_guess["job"]).startswith("ac none, 2 x 1024 tokens, keep")
    assert first_guess["why"].startswith("slower: ")
    assert "(extrapolated: 2,649 tokens/s" in search.format_search(found, eight, 32)


def test_the_line_through_two_depths_reaches_the_model_depth():
    rows = stand_in([search.at_depth(BASE, d) for d in search.DEPTHS], False, False)
    guess = search.extrapolate(rows, search.DEPTHS, 32)
    (deep,) = stand_in([search.at_depth(BASE, 32)], False, False)
    assert guess["step_s"] == pytest.approx(deep["time"]["step_s"])
    assert guess["reserved_bytes"] == pytest.approx((1 + 32 * BASE.per_rank) * GiB)


def test_nothing_fits_and_the_command_says_so():
    huge = lambda jobs, p, ideal: [  # noqa: E731
        {"time": {"step_s": 1.0}, "memory": {"reserved_bytes": 10**15}} for _ in jobs
    ]
    found = search.search(BASE, 32, huge, progress=False)
    assert found["best"] is None and found["confirmed"] is None
    assert "No setting fits the device." in search.format_search(found, BASE, 32)


def test_search_and_sweep_are_refused_together(capsys):
    assert main("plan --model tiny --search --sweep world=2,4".split()) == 2
    assert "--search and --sweep" in capsys.readouterr().err


def test_the_command_searches_the_tiny_model(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(search, "AC", ("none", "block"))  # fewer settings: seconds, not minutes
    monkeypatch.setattr(search, "PER_RANK", (1,))
    out = tmp_path / "search.json"
    picture = tmp_path / "search.png"
    args = "plan --model tiny --world 8 --seq 32 --impls torch --search --no-progress".split()
    assert main([*args, "--json", str(out), "--plot", str(picture)]) == 0
    text = capsys.readouterr().out
    assert "Search over 4 settings" in text and "**Fastest that fits: " in text
    data = json.loads(out.read_text())["search"]
    assert len(data) == 4 and data[0]["why"] == "fastest that fits"
    assert all(d["tokens_per_s"] <= data[0]["tokens_per_s"] for d in data[1:])
    assert picture.stat().st_size > 10_000
