"""Side by side: plain, DDP, twinshard.reference, twinshard.optimized and torch's fully_shard.

    twinshard bench                                   # CPU, gloo, 2 ranks, 'small', all five
    twinshard bench --backend simnet --world 8 --link 2 --json out.json --plot out.png
    twinshard bench --backend fake --world 64 --hsdp 8 --model small
    twinshard bench hooks                             # CPU time per group and step, profiled
    twinshard bench sweep --out benchmarks/results    # model size, groups, world size
    twinshard bench --device cuda --world 1 --model 1b --dtype bf16
    twinshard bench --backend fakeaccel --world 64 --hsdp 8 --offload   # accelerator checks

Backends: ``gloo`` and ``nccl`` start one process per rank; ``fake`` (PyTorch's fake process group:
collectives do nothing) and ``simnet`` (a simulated network: collectives take latency + bytes /
bandwidth of ``--link``) run one process as rank 0 of a world of ``--world`` ranks, with the shapes,
memory and CPU work of that world. With ``simnet`` every implementation also runs on an instant
network, which gives its compute time and so its overlap efficiency. ``fakeaccel`` runs the sharded
implementations on the fake accelerator instead (``twinshard.measure.fakeaccel``): no timings, but
the host syncs, host tensors in collectives, collectives and device memory of rank 0 of a
``--world``-rank accelerator job.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from twinshard.commandline.report_files import publish, write_json
from twinshard.measure import flags
from twinshard.measure.fakeaccel.report import check_and_report
from twinshard.measure.job import BACKENDS, BASELINES, Job

from . import compare, hooks, sweep
from .report import memory_table, meta, plot, table
from .stats import overlap_efficiency


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "mode",
        nargs="?",
        default="compare",
        choices=tuple(compare.DEFAULTS),
        help="compare (default): the implementations side by side; hooks: CPU time per group "
        "and step with tiny blocks, profiled; sweep: model size, groups and world size",
    )
    flags.add(parser, *flags.JOB, "json", "markdown", "no_progress")
    add = parser.add_argument
    add("--device", choices=("cpu", "cuda"), default="cpu")
    add("--backend", choices=BACKENDS, default=None, help="gloo on cpu, nccl on cuda")
    add("--link", default="ib", help="simnet: nvlink, ib, or GB/s")
    add("--latency-us", type=float, default=None, help="simnet: link latency")
    add(
        "--foreach",
        choices=("auto", "on", "off"),
        default=None,
        help="the optimizer's foreach: auto is torch's choice (a loop over the parameters on the "
        "CPU, multi-tensor operations on an accelerator); hooks mode defaults to on",
    )
    add("--warmup", type=int, default=2)
    add("--steps", type=int, default=None, help="timed steps per run")
    add("--repeat", type=int, default=3, help="interleaved repetitions")
    add("--no-memory", action="store_true", help="skip the memory step")
    add("--plot", default=None, help="draw the comparison into this PNG")
    add("--from-json", default=None, help="show a recorded run (its --json)")
    add("--profile", default=None, help="hooks: write cProfile files here")
    add("--out", default="benchmarks/results", help="sweep: where plots go")
    add("--points", default=None, help="sweep: a smaller sweep, e.g. 'quick'")


def run(args) -> int:
    if args.from_json:
        return sweep.replot(args) if args.mode == "sweep" else rerender(args)
    base, impls = compare.job_of(args)
    wrong = compare.problem(args, base, impls)
    if wrong:
        print(f"twinshard bench: error: {wrong}", file=sys.stderr)
        return 2
    if args.mode == "hooks":
        return hooks.run_hooks(args, base, impls)
    if args.mode == "sweep":
        return sweep.run_sweep(args, base, impls)
    if base.backend == "fakeaccel":
        return fake_accelerator(base, impls, args)
    result = compare.side_by_side(base, impls, args.repeat, not args.no_progress)
    if base.memory:
        compare.add_memory_model([(result["summary"], base)])
    if args.json:
        write_json(args.json, {"meta": meta(base.as_dict()), **result})
    show(base, result["summary"], args)
    return 0


def fake_accelerator(base: Job, impls: list[str], args) -> int:
    """``--backend fakeaccel``: the sharded implementations among ``impls`` on the fake
    accelerator (``twinshard.measure.fakeaccel``), two steps each, and its report."""
    sharded = [i for i in impls if i not in BASELINES]  # some: compare.problem says so
    configs = [replace(base, impl=i, device="cpu") for i in sharded]
    options = argparse.Namespace(
        steps=2, no_cpu=False, device="fake", json=args.json, markdown=args.markdown
    )
    return check_and_report(configs, options)


def show(base: Job, summary: dict, args) -> None:
    """Print the tables; write them (``--markdown``) and the plot (``--plot``) if asked."""
    text = describe(base) + "\n\n" + table(summary)
    if base.memory:
        text += "\n\nMemory at the peak (bytes alive by category; model = measure.memory)\n\n"
        text += memory_table(summary)
    publish(text, args.markdown)
    if args.plot:
        plot(summary, args.plot, describe(base))


def rerender(args) -> int:
    """``--from-json FILE``: the tables and plot of a recorded run, without running it again
    (the overlap formula is applied anew; the memory prediction is the one recorded)."""
    with open(args.from_json) as f:
        recorded = json.load(f)
    base = Job(**recorded["meta"]["config"])
    for row in recorded["summary"].values():
        if "compute_s" in row:
            keys = ("compute_s", "comm_s", "step_s", "first_all_gather_s", "last_reduce_scatter_s")
            row["overlap_efficiency"] = overlap_efficiency(*(row[k] for k in keys))
    show(base, recorded["summary"], args)
    if args.json:
        write_json(args.json, recorded)
    return 0


def describe(config: Job) -> str:
    cfg = config.llama()
    mesh = f"{config.replicas}x{config.world // config.replicas}" if config.replicas > 1 else ""
    link = f", link {config.link}" if config.backend == "simnet" else ""
    return (
        f"{config.backend} world {mesh or config.world}{link}, {config.device}, {config.dtype}; "
        f"Llama {config.preset} (dim {cfg.dim}, {cfg.n_layers} blocks, vocab {cfg.vocab_size}), "
        f"{config.per_rank} x {config.seq} tokens per rank, {config.steps} steps x repeats"
    )
