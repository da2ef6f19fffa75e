"""``twinshard plan``: the recorded step's memory, communication and time, checked against
what the model and the implementations must do (issue 26, item 1).

One fresh process records every plan of this module (``plans`` below), on a small Llama at
8 ranks: the parts of the peak add up to the peak, the shards and optimizer states are what
the parameter count says, the collectives are one all-gather per group in forward and
backward and one reduce-scatter per group, the FLOP counter's backward is twice its forward,
checkpointing trades activations for recompute FLOPs, an HF ``config.json`` builds the model
it describes, and the replay hides communication behind compute only where the recorded
waits allow it (synthetic steps, without any recording).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from twinshard.cli import main
from twinshard.measure.plan import config, profiles
from twinshard.measure.plan.cli import plan
from twinshard.measure.plan.replay import replay
from twinshard.measure.plan.summary import add_ratios

BLOCKS = 2
BASE = config.job(model={"n_layers": BLOCKS}, world=8, per_rank=2, seq=64, impl="torch")
HF = dict(
    model_type="llama",
    vocab_size=512,
    hidden_size=128,
    intermediate_size=320,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)
CASES = {
    "torch": BASE,
    "optimized": replace(BASE, impl="optimized"),
    "torch block": replace(BASE, ac="block"),
    "torch selective": replace(BASE, ac="selective"),
    "torch fp32 sgd": replace(BASE, dtype="fp32", optimizer="sgd"),
    "hf": replace(BASE, preset="HF", model={}),
}


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "config.json"
    path.write_text(json.dumps(HF))
    configs = [replace(c, preset=str(path)) if c.preset == "HF" else c for c in CASES.values()]
    rows = plan(configs, progress=False)
    for name, row in zip(CASES, rows):
        assert "error" not in row, f"{name}: {row.get('error')}"
    return dict(zip(CASES, rows))


def _params(cfg: dict) -> int:
    dim, ffn, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = dim // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    block = dim * dim * 2 + dim * kv * 2 + 3 * dim * ffn + 2 * dim
    return cfg["num_hidden_layers"] * block + 2 * vocab * dim + dim


@pytest.mark.parametrize("name", list(CASES))
def test_the_parts_of_the_peak_are_the_peak(plans, name):
    memory = plans[name]["memory"]
    assert memory["peak_bytes"] > 0
    assert sum(memory["parts"].values()) == memory["peak_bytes"]
    assert memory["parts"]["activations"] > 0


def test_shards_and_optimizer_states_are_what_the_parameters_say(plans):
    for name in ("torch", "optimized", "torch fp32 sgd"):
        row = plans[name]
        params, parts = row["model"]["params"], row["memory"]["parts"]
        shard = params * 4 / 8  # fp32 master shards over 8 ranks (padding: < 1 row each)
        assert shard <= parts["sharded"] <= shard * 1.02, name
        states = 1 if row["config"]["optimizer"] == "sgd" else 2  # momentum; exp_avg(_sq)
        assert states * shard <= parts["optimizer"] <= states * shard * 1.02 + 4096, name
    assert plans["hf"]["model"]["params"] == _params(HF)


def test_collectives_are_one_gather_per_group_and_pass_and_one_reduce_scatter(plans):
    for name in ("torch", "optimized"):
        comm = plans[name]["communication"]
        gathers = sum(c["count"] for k, c in comm.items() if k.startswith("all_gather"))
        scatters = sum(c["count"] for k, c in comm.items() if k.startswith("reduce_scatter"))
        # the root keeps its parameters after forward: gathered once
        assert (gathers, scatters) == (2 * BLOCKS + 1, BLOCKS + 1), (name, comm)
        assert all("NVLink" in key for key in comm), comm  # 8 ranks: one node


def test_flops_backward_is_twice_forward_and_checkpointing_recomputes(plans):
    flops = plans["torch"]["time"]["flops"]
    assert flops["backward"] == pytest.approx(2 * flops["forward"], rel=0.02)
    assert "recompute" not in flops
    block = plans["torch block"]
    head = 2 * 8192 * 256 * 2 * 64  # the output projection: not in a block, not recomputed
    assert block["time"]["flops"]["recompute"] == pytest.approx(flops["forward"] - head, rel=0.01)
    assert (
        block["memory"]["parts"]["activations"] < plans["torch"]["memory"]["parts"]["activations"]
    )
    selective = plans["torch selective"]["time"]["flops"]["recompute"]
    assert 0 < selective < block["time"]["flops"]["recompute"]
    assert block["time"]["mfu"] == pytest.approx(
        (flops["forward"] + flops["backward"])
        / block["time"]["step_s"]
        / profiles.DEVICES["h100"].peak(profiles.BF16),
        rel=0.02,
    )


def test_time_is_compute_plus_what_was_not_hidden(plans):
    for row in plans.values():
        t = row["time"]
        assert t["compute_s"] <= t["step_s"] <= t["compute_s"] + t["comm_s"] + 1e-9
        assert t["exposed_s"] <= t["comm_s"] + 1e-9
        assert t["tokens_per_s"] == pytest.approx(2 * 64 / t["step_s"])


def test_ratios_to_torch():
    """Rows with known answers: torch's own ratios are 1, a plan twice as slow as torch's with
    half its peak reads 2.0 and 0.5, a failed plan gets none, and without a plan of torch's
    (or with a failed one) no row gets any."""

    def row(step_s, peak_bytes):
        return {"time": {"step_s": step_s}, "memory": {"peak_bytes": peak_bytes}}

    rows = {"torch": row(2.0, 1000), "optimized": row(4.0, 500), "mine": {"error": "refused"}}
    add_ratios(rows)
    assert rows["torch"]["vs_torch"] == {"step_time": 1.0, "peak_memory": 1.0}
    assert rows["optimized"]["vs_torch"] == {"step_time": 2.0, "peak_memory": 0.5}
    assert "vs_torch" not in rows["mine"]
    for base in ({}, {"torch": {"error": "refused"}}):
        rows = {**base, "optimized": row(4.0, 500)}
        add_ratios(rows)
        assert "vs_torch" not in rows["optimized"]


class Flat:
    """A device and a network whose seconds are given per entry (for the synthetic steps)."""

    name = "flat"

    def seconds(self, flops, *rest):
        return flops

    def link(self, ranks):
        return self


def _step(entries, collectives):
    return {"entries": entries, "collectives": collectives}


def test_replay_hides_only_what_the_waits_allow():
    info = [dict(op="all_gather", bytes=3.0, ranks=[0, 1], group=1)]
    net = Flat()
    net.seconds = lambda op, nbytes, ranks: nbytes  # noqa: E731 (seconds = bytes)
    op = ("op", "default", "forward blocks.0", 2.0, 0, "torch.bfloat16", False)
    # gathered on its own stream, waited for after 2 s of compute: 1 s exposed
    overlapped = [("collective", "ag", 0), op, ("wait_work", "default", 0)]
    timed = replay(_step(overlapped, info), Flat(), net, cpu=False)
    assert (timed["step_s"], timed["exposed_s"]) == (3.0, 1.0)
    assert timed["exposed_by_label_s"] == {"forward blocks.0": 1.0}
    # waited for before the compute: nothing overlaps
    serial = [("collective", "ag", 0), ("wait_work", "default", 0), op]
    timed = replay(_step(serial, info), Flat(), net, cpu=False)
    assert (timed["step_s"], timed["exposed_s"]) == (5.0, 3.0)
    # an event recorded after the collective's stream queued 2 s of work, waited for
    events = [
        ("op", "ag", "x", 2.0, 0, "torch.bfloat16", False),
        ("record_event", "ag", 7),
        ("wait_event", "default", 7),
        op,
    ]
    assert replay(_step(events, []), Flat(), net, cpu=False)["step_s"] == 4.0
    # an event recorded after a collective on its stream: the collective's kernel holds the
    # stream, so the event (and the copy queued behind it) completes only when it ends
    after = [
        ("collective", "ag", 0),
        ("op", "ag", "x", 1.0, 0, "torch.bfloat16", False),  # a copy-out behind it: 3 to 4 s
        ("record_event", "ag", 7),
        ("wait_event", "default", 7),
        op,
    ]
    timed = replay(_step(after, info), Flat(), net, cpu=False)
    assert (timed["step_s"], timed["exposed_s"]) == (6.0, 4.0)


def test_command_writes_table_json_and_picture(tmp_path, capsys):
    out = tmp_path / "plan.json"
    picture = tmp_path / "plan.png"
    args = "plan --model tiny --world 4 --seq 32 --impls torch --no-progress".split()
    assert main([*args, "--json", str(out), "--plot", str(picture)]) == 0
    text = capsys.readouterr().out
    assert "| **peak device memory (MiB)** |" in text and "tokens/s per rank" in text
    assert "| ideal step (ms) |" in text and "| FSDP overhead / torch's | 1.000 |" in text
    row = json.loads(out.read_text())["plans"][0]
    assert row["config"]["world"] == 4 and row["memory"]["fits"]["h100"]
    # the caching allocator's model over the recorded requests (tests/measuring/test_allocator_model.py)
    assert "| **reserved peak (MiB)** |" in text and "| fits b200 (167 GiB) | yes |" in text
    mem, model = row["memory"], row["memory"]["allocator"]["segments"]
    assert model["reserved_peak"] >= model["allocated_peak"] >= model["requested_peak"]
    assert model["requested_peak"] >= mem["peak_bytes"] > 0  # every step's, the measured one's
    assert (
        model["reserved_peak"] % (2 << 20) == 0 and mem["reserved_bytes"] == model["reserved_peak"]
    )
    t = row["time"]  # the ideal step (tests/measuring/test_plan_ideal.py) and the overhead over it
    assert t["overhead_s"] == pytest.approx(t["step_s"] - t["ideal_s"]) and t["overhead_s"] > 0
    assert picture.stat().st_size > 10_000


def test_sweep_prints_a_table_per_point_and_plots_them(tmp_path, capsys):
    picture = tmp_path / "sweep.png"
    args = "plan --model tiny --seq 32 --impls torch --sweep world=2,4 --no-progress".split()
    assert main([*args, "--plot", str(picture)]) == 0
    text = capsys.readouterr().out
    assert "2 ranks, FSDP" in text and "4 ranks, FSDP" in text
    assert picture.stat().st_size > 10_000


def test_a_plan_prices_the_variants_wire(tmp_path):
    """``--variants qwz+qgz`` (twinshard.variants) replaces torch's all-gathers by gathers of
    int8 blocks and its reduce-scatters by all-to-alls of them: fewer bytes on every link
    (bf16 weights and fp32 gradients against 1 + 4 / 256 bytes an element, partial blocks
    aside), the same model and step otherwise."""
    out = tmp_path / "plan.json"
    args = (
        "plan --model small --layers 2 --seq 64 --world 8 --impls torch --no-progress --device h100"
    )
    assert main([*args.split(), "--sweep", "variants=none,qwz+qgz", "--json", str(out)]) == 0
    plain, quantized = json.loads(out.read_text())["plans"]  # one per sweep point
    links = {k.split(" @ ")[0]: v for k, v in quantized["communication"].items()}
    plain_links = {k.split(" @ ")[0]: v for k, v in plain["communication"].items()}
    assert "reduce_scatter" not in links and links["all_to_all"]["count"] > 0
    assert links["all_gather"]["count"] == plain_links["all_gather"]["count"]
    gathered = links["all_gather"]["bytes"] / plain_links["all_gather"]["bytes"]
    reduced = links["all_to_all"]["bytes"] / plain_links["reduce_scatter"]["bytes"]
    assert 0.5 < gathered < 0.6 and 0.25 < reduced < 0.3, (gathered, reduced)
    assert quantized["config"]["variants"] == "qwz+qgz"


def test_torchs_own_copy_operators_are_priced_as_the_copies_they_make():
    """torch's fully_shard copies through fsdp:: operators, which a dispatch mode sees but not
    the copies inside them: each is priced as the bytes it reads plus those it writes."""
    import torch
    import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401 - defines fsdp::

    from twinshard.measure.plan.trace import fsdp_copy_bytes

    fsdp = torch.ops.fsdp
    shards = [torch.zeros(6, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.bfloat16)]
    output = torch.empty(4 * 8, dtype=torch.bfloat16)  # 4 ranks' slots of 8 elements
    args = (shards, output, [6, 2], 8, 1)
    assert fsdp_copy_bytes("all_gather_copy_in", fsdp.all_gather_copy_in.default, args, {}) == 32
    params = [torch.empty(4, 6), torch.empty(4, 2)]
    gathered = torch.zeros(4, 8)
    kwargs = {"dim": 1, "out": params}
    copy_out = fsdp.split_with_sizes_copy.default
    assert fsdp_copy_bytes("split_with_sizes_copy", copy_out, (gathered, [6, 2]), kwargs) == 256
    grads = [torch.zeros(4, 3, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16)]
    packed = torch.empty(2, 8)  # fp32: cast as it packs
    chunk = fsdp.chunk_cat.default
    assert fsdp_copy_bytes("chunk_cat", chunk, (grads, 0, 2), {"out": packed}) == 32 + 64
    assert fsdp_copy_bytes("something_else", chunk, (grads, 0, 2), {"out": packed}) == 0
