"""``twinshard plan``'s ideal step (issue 33): the job's model with no FSDP, and each
implementation's FSDP overhead over it.

One fresh process records the plans of this module: a small Llama at 8 ranks with each
implementation, the same job with other FSDP-only settings and with more tokens, and the
ideal's own job recorded as a plan of its own. The ideal must be the plain model's compute,
below every implementation's compute (FSDP adds work to the compute stream and removes none of
the model's), one for a job whatever the implementation and its FSDP settings, and larger for
more tokens.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from twinshard.measure.plan import config
from twinshard.measure.plan.cli import plan
from twinshard.measure.plan.ideal import job as ideal_job
from twinshard.measure.plan.summary import add_ideal, add_ratios

BASE = config.job(model={"n_layers": 2}, world=8, per_rank=2, seq=64, impl="torch", ac="block")
CASES = {
    "torch": BASE,
    "optimized": replace(BASE, impl="optimized"),
    "reference": replace(BASE, impl="reference"),
    "torch kept": replace(BASE, reshard_after_forward=False),
    "torch more tokens": replace(BASE, per_rank=4),
}


@pytest.fixture(scope="module")
def plans():
    jobs = [*CASES.values(), ideal_job(BASE)]
    rows = plan(jobs, progress=False)
    for name, row in zip([*CASES, "plain"], rows):
        assert "error" not in row, f"{name}: {row.get('error')}"
    return dict(zip([*CASES, "plain"], rows))


def test_the_ideal_is_the_plain_models_step_doing_the_same_math(plans):
    plain = plans["plain"]
    assert plain["communication"] == {}
    assert plain["time"]["exposed_s"] == 0
    assert plain["time"]["overhead_s"] == pytest.approx(0, abs=1e-12)  # its own ideal
    for name in ("torch", "optimized", "reference"):
        row = plans[name]
        assert row["time"]["ideal_s"] == plain["time"]["compute_s"]  # recorded apart
        for kind in ("forward", "backward", "recompute"):  # the model's FLOPs, all of them
            assert plain["time"]["flops"][kind] == pytest.approx(row["time"]["flops"][kind])


def test_the_optimizer_costs_what_the_ideals_costs(plans):
    """Both step the rank's shards: FSDP's optimizer over ``DTensor`` parameters is priced by
    their local tensors, not their global shape (8x as many bytes at 8 ranks)."""
    plain = plans["plain"]["time"]["compute_by_label_s"]["optimizer step"]
    for name in ("torch", "optimized", "reference"):
        fsdp = plans[name]["time"]["compute_by_label_s"]["optimizer step"]
        assert fsdp == pytest.approx(plain, rel=0.05), name


def test_the_ideal_is_below_every_implementations_compute(plans):
    for name in ("torch", "optimized", "reference", "torch kept"):
        t = plans[name]["time"]
        assert 0 < t["ideal_s"] < t["compute_s"] <= t["step_s"], name
        assert t["overhead_s"] == pytest.approx(t["step_s"] - t["ideal_s"])


def test_one_ideal_per_job_whatever_the_fsdp(plans):
    ideals = {plans[n]["time"]["ideal_s"] for n in ("torch", "optimized", "reference")}
    assert len(ideals) == 1
    assert plans["torch kept"]["time"]["ideal_s"] in ideals
    assert plans["torch more tokens"]["time"]["ideal_s"] > max(ideals)


def test_the_ideals_optimizer_steps_the_ranks_shards():
    """The ideal's optimizer works on fp32 tensors of the shards' shapes, with a gradient each
    time it steps, and the model's own gradients are dropped then."""
    import torch

    from twinshard.measure.plan import ideal
    from twinshard.models import Llama

    job = replace(BASE, world=4, optimizer="sgd", device="cpu")
    with torch.device("meta"):
        model = Llama(job.llama())
    model, opt = ideal.build(job, torch.device("cpu"), model)
    shards = opt.param_groups[0]["params"]
    for p, shard in zip(model.parameters(), shards):
        assert p.dtype == torch.bfloat16 and shard.dtype == torch.float32
        assert shard.shape[0] == -(-p.shape[0] // 4) and shard.shape[1:] == p.shape[1:]
    first = next(model.parameters())
    first.grad = torch.zeros_like(first)
    opt.step()
    assert all(p.grad is None for p in model.parameters())
    assert all("momentum_buffer" in opt.state[s] for s in shards)


def test_overhead_ratio_to_torch():
    """Rows with known answers: torch's overhead ratio is 1, a half overhead reads 0.5, and a
    row without an ideal gets none."""

    def row(step_s, ideal_s=None):
        r = {"time": {"step_s": step_s}, "memory": {"peak_bytes": 1}}
        if ideal_s is not None:
            add_ideal(r, ideal_s)
        return r

    rows = {"torch": row(3.0, 1.0), "optimized": row(2.0, 1.0), "mine": row(2.0)}
    add_ratios(rows)
    assert rows["torch"]["vs_torch"]["fsdp_overhead"] == 1.0
    assert rows["optimized"]["vs_torch"]["fsdp_overhead"] == 0.5
    assert "fsdp_overhead" not in rows["mine"]["vs_torch"]


def test_a_failed_ideal_is_said_and_the_plan_stands(plans):
    from twinshard.measure.plan.table import format_plan

    row = {**plans["torch"], "time": dict(plans["torch"]["time"])}
    for key in ("ideal_s", "overhead_s"):
        del row["time"][key]
    row["time"]["ideal_error"] = "RuntimeError: boom"
    text = format_plan({"torch": row})
    assert "ideal step: failed: RuntimeError: boom" in text
    assert "| ideal step (ms) | failed |" in text and "| **step time (ms)** |" in text
