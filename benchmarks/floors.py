"""How low each of issue 33's missed targets can go: a floor under the quantity the target
bounds, measured from what any FSDP step of that job must do, beside the bound.

    python benchmarks/floors.py                    # both parts, about 3 minutes
    python benchmarks/floors.py --only overhead    # the 70B plan's floor, about 20 seconds
    python benchmarks/floors.py --only gloo        # the gloo step's floor, about 2.5 minutes

``overhead``: the FSDP overhead of ``targets.py``'s 70B job (Llama 3 70B, 8 of its 80 blocks,
1,024 H100s, 4 sequences of 8,192 per rank) is its planned step minus the ideal step (the
compute alone). With the root and the first block in pieces (``twinshard.optimized.in_pieces``:
[Note: the root's parameters in pieces] and [Note: the first block in two pieces] in
``optimized/pieces.py``), the step's two ends are the collectives of the groups that run first
in forward and last in backward: the root's first piece (the embedding) and the first block's
two pieces, three all-gathers at the start and three reduce-scatters at the end. The start
cannot go faster than one link carrying those three all-gathers back to back while each piece
computes as soon as its own has arrived, nor the end faster than the three reduce-scatters
going out as soon as each piece's backward is done, and the recorded step does exactly that.
So the floor is the recorded step replayed with those six collectives timed by the planner's
network and every other collective free (nothing in the middle of the step can then expose
anything), minus the ideal step: what this grouping costs at its ends, whatever happens in
between. Issue 53's targets for it: ``twinshard.optimized.in_pieces``'s planned overhead at most
0.6x torch's and within 5% of this floor.

``gloo``: the gloo step at 2 ranks of ``targets.py`` (the ``small`` model, 4 x 128 tokens per
rank). Both ranks compute on the machine's 2 cores, and gloo moves bytes over loopback with the
same cores, so the communication adds to the compute unless it waits on something other than
a core. The floor is the plain model's step (``twinshard bench --impls plain``) plus the
collectives of one step alone, with no model: every group all-gathered in forward and again in
backward, and reduced once, each by the cheapest exchange gloo has at 2 ranks (an all-to-all
of the halves; the reduction's all-to-all moves half of what an all-reduce moves).

Each part prints a Markdown table and, with ``--out DIR``, writes it to
``DIR/<date>-floors-<part>.md``; the exit status is 1 when the optimized path misses issue 53's
targets (``overhead``) or when the gloo floor is above its bound (the bound cannot be met by a
schedule of that kind on that machine), else 0.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import targets  # noqa: E402  (the jobs and bounds of issue 33's targets)

GLOO_STEPS = 15  # comm-only steps per rank; the first 3 are warm-up
PIECES = "twinshard.optimized.in_pieces"  # the root's parameters in pieces
PIECES_BOUND = 0.6  # issue 53: the planned overhead at most 0.6x torch's
FLOOR_MARGIN = 1.05  # ... and within 5% of the floor
ENDS = 3  # the collectives at each end: the root's first piece, the first block's two pieces


def overhead_floor(blocks: int) -> tuple[list[str], bool]:
    """The 70B job's overhead floor beside the planned overheads and the bounds on them;
    returns the lines and whether a bound is missed."""
    from twinshard.measure.plan import cli, runner
    from twinshard.measure.plan.replay import replay

    job = replace(targets.seventy_b(blocks), impl=PIECES)
    # in a fresh process, as ``twinshard plan`` records: recording registers the fake
    # accelerator, which would then be this process's accelerator
    (recorded,) = runner.record_many([job], progress=False)
    device, network = cli.device_and_network(job, None)
    calls = recorded["collectives"]
    gathers = [i for i, c in enumerate(calls) if c["op"] == "all_gather"][:ENDS]
    reductions = [i for i, c in enumerate(calls) if c["op"] == "reduce_scatter"][-ENDS:]
    timed = set(gathers + reductions)
    ends = copy.deepcopy(recorded)
    rows = []
    for i, c in enumerate(ends["collectives"]):
        if i not in timed:
            c["bytes"] = 0  # free: see OnlyTheEnds
            continue
        seconds = network.seconds(c["op"], c["bytes"], c["ranks"])
        rows.append(f"| {c['op']} | {c['label']} | {c['bytes'] / 1e9:.3f} | {seconds * 1e3:.1f} |")
    impls = ("optimized", PIECES, "torch")
    plans = cli.plan([replace(job, impl=i) for i in impls], progress=False)
    plan_of = dict(zip(impls, plans))
    by_impl = {i: plan["time"]["overhead_s"] for i, plan in plan_of.items()}
    cpu = recorded["config"]["device"] == "cpu"  # as the plan replays it
    ideal = plan_of[PIECES]["time"]["ideal_s"]
    floor = replay(ends, device, OnlyTheEnds(network), cpu)["step_s"] - ideal
    bound = targets.BOUNDS["overhead"] * by_impl["torch"]
    ours, theirs = by_impl[PIECES], by_impl["torch"]
    met_torch = ours <= PIECES_BOUND * theirs
    met_floor = ours <= FLOOR_MARGIN * floor
    lines = [
        f"## FSDP overhead floor: Llama 3 70B, {blocks} of 80 blocks, 1,024 H100s, bs4",
        "",
        f"The collectives at the two ends of `{PIECES}`'s recorded step, each alone on the link:",
        "",
        "| collective | issued at | GB | ms |",
        "|---|---|---:|---:|",
        *rows,
        "",
        f"- floor (the step replayed with only these timed, minus the ideal step): "
        f"**{floor * 1e3:.1f} ms**",
        f"- planned overhead: {PIECES} {ours * 1e3:.1f} ms, optimized (the root one group) "
        f"{by_impl['optimized'] * 1e3:.1f} ms, torch {theirs * 1e3:.1f} ms",
        f"- issue 33's bound {targets.BOUNDS['overhead']}x torch's: {bound * 1e3:.1f} ms; "
        f"floor / torch = {floor / theirs:.3f}x",
        f"- issue 53: in pieces / torch = {ours / theirs:.3f}x (bound {PIECES_BOUND}x): "
        f"{'met' if met_torch else 'MISSED'}; in pieces / floor = {ours / floor:.3f}x (bound "
        f"{FLOOR_MARGIN}x): {'met' if met_floor else 'MISSED'}",
    ]
    return lines, not (met_torch and met_floor)


class OnlyTheEnds:
    """The planner's ``network``, with a collective of no bytes free: the floor's replay sets
    every collective but the step's ends to none."""

    def __init__(self, network):
        self.network = network

    def seconds(self, op: str, nbytes: int, ranks: list[int]) -> float:
        return 0.0 if nbytes == 0 else self.network.seconds(op, nbytes, ranks)


def group_sizes() -> list[int]:
    """Elements of each group of the gloo target's job: every block, then the root."""
    from twinshard.models import Llama

    model = Llama(gloo_job().llama())
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    return blocks + [sum(p.numel() for p in model.parameters()) - sum(blocks)]


def gloo_job():
    from twinshard.measure.bench.cli import add_arguments
    from twinshard.measure.bench.compare import job_of

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    job, _ = job_of(parser.parse_args(targets.CPU_BENCH.split()))
    return job


def comm_only(sizes: list[int]) -> list[float]:
    """One rank of the comm-only step (``twinshard.ranks.launch``, 2 gloo ranks): the seconds of
    ``GLOO_STEPS`` steps of the step's collectives alone, after 3 of warm-up."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = dist.get_rank()
    peer = 1 - rank
    splits = [0, 0]
    splits[peer] = 1  # scaled below: this rank sends its half to the peer and takes the peer's
    gathered = [torch.zeros(2, n // 2) for n in sizes]  # (ranks, per-rank) each group's buffer
    grads = [torch.zeros(2, n // 2) for n in sizes]  # (ranks, per-rank) its packed gradients

    def exchange(into: torch.Tensor, send: torch.Tensor) -> None:
        n = send.numel()
        sizes_ = [s * n for s in splits]
        dist.all_to_all_single(into, send, output_split_sizes=sizes_, input_split_sizes=sizes_)

    times = []
    for _ in range(GLOO_STEPS):
        dist.barrier()
        started = time.perf_counter()
        for g in gathered:  # forward
            exchange(g[peer], g[rank])
        for g, grad in zip(reversed(gathered), reversed(grads)):  # backward
            exchange(g[peer], g[rank])
            incoming = torch.empty_like(grad[rank])
            exchange(incoming, grad[peer])
            grad[rank].add_(incoming)
        times.append(time.perf_counter() - started)
    return times[3:]


def gloo_floor() -> tuple[list[str], bool]:
    """The gloo step's floor beside the measured steps and the 0.75x bound."""
    from twinshard.ranks.launch import launch

    sizes = group_sizes()
    comm = statistics.median(launch(comm_only, 2, sizes, backend="gloo")[0])
    with tempfile.TemporaryDirectory() as scratch:
        bench = os.path.join(scratch, "bench.json")
        args = targets.CPU_BENCH.replace("--impls optimized,torch", "--impls plain,optimized,torch")
        cmd = [sys.executable, "-m", "twinshard.cli", "bench", *args.split(), "--json", bench]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        with open(bench) as f:
            steps = {i: r["step_s"] for i, r in json.load(f)["summary"].items()}
    floor = steps["plain"] + comm
    bound = targets.BOUNDS["cpu"] * steps["torch"]
    lines = [
        "## gloo step floor: 2 ranks, the `small` model, 4 x 128 tokens per rank",
        "",
        f"- groups: {len(sizes)} ({sizes[0]:,} elements per block, {sizes[-1]:,} the root)",
        f"- plain step {steps['plain'] * 1e3:.1f} ms + the collectives alone "
        f"{comm * 1e3:.1f} ms = floor **{floor * 1e3:.1f} ms**",
        f"- measured steps: optimized {steps['optimized'] * 1e3:.1f} ms, torch "
        f"{steps['torch'] * 1e3:.1f} ms",
        f"- bound {targets.BOUNDS['cpu']}x torch's: {bound * 1e3:.1f} ms; floor / torch = "
        f"{floor / steps['torch']:.3f}x",
        f"- `twinshard bench {args}`",
    ]
    return lines, floor > bound


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="overhead,gloo", help="overhead, gloo or both")
    parser.add_argument("--blocks", type=int, default=8, help="blocks of the 70B job")
    parser.add_argument("--out", help="a folder for the results")
    args = parser.parse_args()
    above = False
    for part in [p for p in args.only.split(",") if p]:
        if part not in ("overhead", "gloo"):
            sys.exit(f"benchmarks/floors.py: unknown part {part!r}; choose overhead or gloo")
        lines, over = overhead_floor(args.blocks) if part == "overhead" else gloo_floor()
        above = above or over
        text = "\n".join(lines) + "\n"
        print(text, flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            name = f"{datetime.date.today()}-floors-{part}.md"
            with open(os.path.join(args.out, name), "w") as f:
                f.write(f"# {name[:-3]}\n\n`python benchmarks/floors.py --only {part}`\n\n{text}")
    return 1 if above else 0


if __name__ == "__main__":
    raise SystemExit(main())
