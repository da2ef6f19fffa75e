"""What the schedule's picture says about memory and collectives: the sharded parameters and
gradients counted through the step, the accelerator's whole allocation where there is one, and
a title and legend that name and count every collective drawn.

The model is test_schedule.py's: the tiny Llama with 3 blocks on 2 ranks, 53,376 float32
parameters per block and 32,832 at the root, nothing padded, so each rank holds half of
them: (3 * 53,376 + 32,832) * 4 / 2 = 385,920 bytes of parameter shards, and as many of
gradient shards once backward has reduced every group.
"""

from __future__ import annotations

import pytest

from twinshard.measure.schedule import plot_timeline
from twinshard.measure.schedule.cli import record_fake_steps, record_on_rank
from twinshard.measure.schedule.timeline import drawn
from twinshard.ranks.launch import launch

SHARDS = (3 * 53_376 + 32_832) * 4 // 2  # bytes of parameter shards per rank


def _record_both():
    return {impl: record_on_rank(impl) for impl in ("reference", "optimized")}


@pytest.fixture(scope="module")
def recorded():
    return launch(_record_both, 2, start_method="fork", timeout=240)[0]


@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_the_shards_are_counted_all_step_and_the_gradients_join_them(recorded, impl):
    """Unsharding a group hides its shard from the module, not from memory: the line never
    drops below the parameter shards, and ends with the gradient shards added."""
    sharded = [e.sharded_bytes for e in recorded[impl].events]
    assert sharded[0] == SHARDS and min(sharded) == SHARDS
    assert sharded[-1] == 2 * SHARDS
    assert sharded == sorted(sharded)  # gradient shards only arrive during backward
    assert all(e.device_bytes is None for e in recorded[impl].events)  # gloo: no allocator


@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_the_title_and_legend_name_and_count_every_collective_drawn(recorded, impl):
    """On gloo the optimized path all-reduces its gradients: the title must say so (and that
    there are no reduce-scatters), and the legend must have a marker for it."""
    schedule = recorded[impl]
    figure = plot_timeline(schedule)
    title = figure.subfigs[0].axes[0].get_title(loc="left")
    legend = [t.get_text() for t in figure.subfigs[-1].legends[0].get_texts()]
    ops = {c.op for c in drawn(schedule)}
    assert ops >= {"all_gather"} and (impl != "optimized" or "all_reduce" in ops)
    for op in ops | {"all_gather", "reduce_scatter"}:
        count = sum(c.op == op for c in drawn(schedule))
        name = op.replace("_", "-")
        assert f"{count} {name}" in title, (op, title)
        if op in ops:
            assert f"{name} (blocking)" in legend, (op, legend)
    assert "bytes: sharded parameters and gradients" in legend
    assert "bytes: all the accelerator holds" not in legend


def test_on_the_fake_accelerator_the_allocator_line_holds_everything_else():
    """There every event also has the allocator's total, which holds the shards, the
    unsharded parameters and the gradient buffers, and more (activations)."""
    (schedule,) = record_fake_steps(["optimized"], 4)
    for e in schedule.events:
        parts = e.sharded_bytes + e.unsharded_bytes + e.grad_bytes
        assert e.device_bytes is not None and e.device_bytes >= parts, e
    assert max(e.device_bytes for e in schedule.events) > max(
        e.sharded_bytes + e.unsharded_bytes + e.grad_bytes for e in schedule.events
    )
    figure = plot_timeline(schedule)
    legend = [t.get_text() for t in figure.subfigs[-1].legends[0].get_texts()]
    assert "bytes: all the accelerator holds" in legend
