"""``benchmarks/targets.py``'s arithmetic and verdict (issue 33), never its timings: the plans
are replaced by rows with known figures, so that the verdicts, the exit status and the files
written can be checked without recording anything."""

from __future__ import annotations

import json

import pytest
from benchmark_scripts import load


@pytest.fixture(scope="module")
def targets():
    return load("targets")


def _row(step_s, peak, ideal_s=None):
    time = {"step_s": step_s} | ({} if ideal_s is None else {"overhead_s": step_s - ideal_s})
    return {"time": time, "memory": {"peak_bytes": peak}}


def test_a_target_is_met_up_to_its_bound_and_a_failed_figure_is_a_miss(targets):
    assert targets.target("at the bound", 1.0, 2.0, 0.5, "ms")["met"]
    missed = targets.target("over it", 1.01, 2.0, 0.5, "ms")
    assert not missed["met"] and missed["ratio"] == pytest.approx(0.505)
    assert not targets.target("failed", None, 2.0, 1.0, "ms")["met"]
    assert not targets.target("negative overhead", 1.0, -1.0, 0.5, "ms")["met"]


def test_overhead_step_and_memory_rows(targets):
    plans = {
        "job": {"optimized": _row(10.0, 100, ideal_s=9.0), "torch": _row(11.0, 90, ideal_s=9.0)}
    }
    (overhead,) = targets.plan_targets(plans, ["job"])
    assert overhead["ratio"] == pytest.approx(0.5) and overhead["met"]  # 1 s against 2 s
    step, memory = targets.published_targets(plans, ["job"])
    assert step["met"] and not memory["met"]  # faster than torch's, but 100 > 90 bytes
    plans["job"]["optimized"] = {"error": "it broke"}
    assert not any(r["met"] for r in targets.published_targets(plans, ["job"]))


@pytest.mark.parametrize("optimized_step, status", [(10.0, 0), (12.0, 1)])
def test_exit_status_and_files(targets, monkeypatch, tmp_path, optimized_step, status):
    """Exit 0 when every target is met, 1 when one is missed; the table and JSON written."""
    plans = {"a run": {"optimized": _row(optimized_step, 90), "torch": _row(11.0, 90)}}
    monkeypatch.setattr(targets, "planned", lambda parts, blocks: (plans, {"compute_bound": []}))
    monkeypatch.setattr(targets.published_runs, "RUNS", {"a run": None})
    assert targets.main(["--only", "published", "--out", str(tmp_path)]) == status
    (written,) = tmp_path.glob("*-targets-published.json")
    rows = json.loads(written.read_text())["targets"]
    assert [r["met"] for r in rows] == [status == 0, True]
    assert "| planned step, a run (ms) |" in written.with_suffix(".md").read_text()


def test_another_implementation_held_to_the_planned_targets(targets, monkeypatch, tmp_path):
    """``--ours`` plans that implementation in place of ``optimized``, and says so."""
    ours = "twinshard.optimized.in_pieces"
    plans = {"a run": {ours: _row(10.0, 80), "torch": _row(11.0, 90)}}
    monkeypatch.setattr(targets, "planned", lambda parts, blocks: (plans, {"compute_bound": []}))
    monkeypatch.setattr(targets.published_runs, "RUNS", {"a run": None})
    try:
        assert targets.main(["--only", "published", "--ours", ours, "--out", str(tmp_path)]) == 0
        assert targets.IMPLS == (ours, "torch")
    finally:
        targets.IMPLS = ("optimized", "torch")
    (written,) = tmp_path.glob("*-targets-published-in_pieces.md")
    assert f"({ours} in the optimized column)" in written.read_text()
    with pytest.raises(SystemExit):
        targets.main(["--only", "cpu", "--ours", ours, "--out", str(tmp_path)])
