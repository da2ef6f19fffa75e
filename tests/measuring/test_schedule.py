"""The schedule view: what it records of one step of the reference, the optimized path and
torch's fully_shard, and what it prints and draws.

The model is the tiny Llama with 3 blocks on 2 ranks. Its widths are even, so nothing is
padded: a block holds 53,376 parameters (4 * 64 * 64 attention, 3 * 64 * 192 feed-forward,
2 * 64 norms) and the root 32,832 (two 256 x 64 matrices and a norm), in float32.
"""

import re
import subprocess
import sys

import pytest
import torch

from twinshard.measure import step
from twinshard.measure.schedule import Recorder, format_table
from twinshard.measure.schedule.cli import example, record_on_rank
from twinshard.ranks.launch import launch

BLOCK, ROOT = 53_376 * 4, 32_832 * 4  # bytes
BLOCKS = ["blocks.0", "blocks.1", "blocks.2"]
HOOK_ORDER = (
    ["pre_forward root"]
    + [f"{h} {b}" for b in BLOCKS for h in ("pre_forward", "post_forward")]
    + ["post_forward root", "pre_backward root"]
    + [f"{h} {b}" for b in reversed(BLOCKS) for h in ("pre_backward", "post_backward")]
    + ["final_callback root"]
)


def _record_all():
    found = {impl: record_on_rank(impl) for impl in ("reference", "optimized", "torch")}
    found["bf16"] = record_on_rank("optimized", param_dtype="bf16", reduce_dtype="fp32")
    found["grads_unchanged"] = _recording_changes_nothing()
    return found


def _recording_changes_nothing() -> bool:
    """The same step with and without a recorder gives bitwise the same gradients."""
    grads = []
    for record in (False, True):
        job = example("reference", 2, layers=2)
        net, _ = step.build(job, torch.device("cpu"))
        tokens = step.tokens(job, net.config.vocab_size, rank=0)
        recorder = Recorder(net)
        if record:
            with recorder:
                step.loss(net, tokens).backward()
        else:
            step.loss(net, tokens).backward()
        grads.append([p.grad.to_local().clone() for p in net.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.fixture(scope="module")
def recorded():
    return launch(_record_all, 2, start_method="fork", timeout=240)


def _hooks(schedule):
    return [f"{e.hook} {e.group or 'root'}" for e in schedule.events]


def _event(schedule, hook, group):
    (e,) = schedule.events_of(hook, group)
    return e


def test_every_implementation_runs_the_same_hooks_in_the_same_order(recorded):
    for impl in ("reference", "optimized", "torch"):
        assert _hooks(recorded[0][impl]) == HOOK_ORDER, impl


def test_reference_gathers_one_parameter_at_a_time_and_holds_one_block(recorded):
    s = recorded[0]["reference"]
    assert all(c.blocking for c in s.collectives)
    assert all(c.group is not None for c in s.collectives if not c.bookkeeping)
    # who had gradients is tallied through the store, not a collective (reference/more/usage.py)
    assert not [c for c in s.collectives if c.bookkeeping]
    for block in BLOCKS:
        forward = [c for c in s.calls("all_gather", block) if s.events[c.event].phase == "forward"]
        assert sorted(p for c in forward for p in c.params) == sorted(s.params[block])
        assert all(len(c.params) == 1 for c in forward)
        assert len(s.calls("reduce_scatter", block)) == len(s.params[block])
    for e in s.events:
        assert len([g for g in s.unsharded_groups(e) if g]) <= 1, e
    assert max(e.unsharded_bytes for e in s.events) == ROOT + BLOCK


def test_optimized_issues_the_next_blocks_all_gather_before_this_block_computes(recorded):
    s = recorded[0]["optimized"]
    for i in range(2):  # forward: block i+1's all-gather goes out in block i's pre_forward
        (gather,) = [
            c for c in s.calls("all_gather", BLOCKS[i + 1]) if s.events[c.event].phase == "forward"
        ]
        assert gather.event == _event(s, "pre_forward", BLOCKS[i]).index
        assert not gather.blocking
        assert gather.used_tick > _event(s, "post_forward", BLOCKS[i]).tick
        assert gather.params == tuple(s.params[BLOCKS[i + 1]])  # one collective for the group
    for i in (2, 1):  # backward: block i-1's all-gather goes out in block i's pre_backward
        (gather,) = [
            c for c in s.calls("all_gather", BLOCKS[i - 1]) if s.events[c.event].phase == "backward"
        ]
        assert gather.event == _event(s, "pre_backward", BLOCKS[i]).index
    assert max(len([g for g in s.unsharded_groups(e) if g]) for e in s.events) == 1
    # One block in flight: after a hook, at most one all-gather is issued and not yet read.
    gathers = s.calls("all_gather")
    in_flight = [
        len([c for c in gathers if c.tick < e.tick and (c.used_tick or e.tick + 1) > e.tick])
        for e in s.events
    ]
    assert max(in_flight) == 1, in_flight
    # The bytes seen after a hook: the root, the block that computes and the one prefetched
    # (an all-gather output counts until the copy-out reads it, however long gloo's worker
    # thread holds on to it after that).
    assert max(e.unsharded_bytes for e in s.events) == ROOT + 2 * BLOCK


def test_torch_is_recorded_with_one_collective_per_group(recorded):
    s = recorded[0]["torch"]
    assert all(c.group is not None for c in s.collectives)
    for block in BLOCKS:
        assert [c.params for c in s.calls("all_gather", block)] == [tuple(s.params[block])] * 2
        assert len(s.calls("reduce_scatter", block)) == 1
    assert {s.group_state(s.events[-1], g) for g in s.groups} == {"S"}


def test_mixed_precision_shows_in_the_dtypes(recorded):
    s = recorded[0]["bf16"]
    assert {c.dtype for c in s.calls("all_gather")} == {"bfloat16"}
    # on gloo the gradients are all-reduced in place: [Note: reduce-scatter on gloo]
    assert not s.calls("reduce_scatter")
    reductions = [c for c in s.calls("all_reduce") if not c.bookkeeping]
    assert len(reductions) == len(s.groups)  # one per group
    assert {c.dtype for c in reductions} == {"float32"}
    assert all(c.group is not None for c in s.collectives if not c.bookkeeping)


def test_ranks_record_the_same_collectives_and_recording_changes_no_gradient(recorded):
    for impl in ("reference", "optimized", "torch"):
        a, b = ([(c.op, c.nbytes, c.group, c.event) for c in r[impl].collectives] for r in recorded)
        assert a == b, impl
    assert recorded[0]["grads_unchanged"] and recorded[1]["grads_unchanged"]


def test_text_table_has_a_row_per_hook_and_a_line_per_collective(recorded):
    s = recorded[0]["reference"]
    text = format_table(s)
    rows = re.findall(r"^\s*\d+\s+(\w+)\s+(\S+)\s+[USP*-]\s", text, flags=re.M)
    assert [f"{h} {g}" for h, g in rows] == HOOK_ORDER
    assert len(re.findall(r"^\s+all_gather\s+float32", text, flags=re.M)) == len(
        s.calls("all_gather")
    )
    assert "pre_forward     blocks.0     U       U         S         S" in text
    compact = format_table(s, compact=True)
    assert compact.count("blocks.0: 9 params, one all-gather each  [blocking]") == 2
    assert "-> blocks.1 (9 params)  [async, used in #3]" in format_table(recorded[0]["optimized"])


def test_cli_writes_the_picture_and_the_table(tmp_path):
    png, txt = tmp_path / "step.png", tmp_path / "step.txt"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "twinshard.cli",
            "schedule",
            "--impl",
            "reference,torch",
            "--model",
            "mlp",
            "--layers",
            "2",
            "--out",
            str(png),
            "--text",
            str(txt),
            "--compact",
            "--quiet",
        ],
        check=True,
        timeout=300,
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    text = txt.read_text()
    assert text.startswith("reference, rank 0 of 2") and "\ntorch, rank 0 of 2" in text
    assert text.count("final_callback  root") == 2
    assert "-> blocks.0: 6 params, one all-gather each  [blocking]" in text  # reference, compact


def test_a_post_forward_piece_is_seen_from_the_smaller_all_gather():
    s = launch(
        record_on_rank,
        4,
        "reference",
        model="mlp",
        layers=2,
        reshard_after_forward=2,
        start_method="fork",
        timeout=240,
    )[0]
    after_forward = _event(s, "post_forward", "blocks.0")
    assert s.group_state(after_forward, "blocks.0") == "P"
    backward = [
        c for c in s.calls("all_gather", "blocks.0") if s.events[c.event].phase == "backward"
    ]
    assert backward and {c.ranks for c in backward} == {2}
    assert s.group_state(_event(s, "pre_backward", "blocks.0"), "blocks.0") == "U"
