"""Plan a training job from this CPU: memory, communication and predicted time, per rank.

    twinshard plan --model llama3-8b --world 64 --seq 8192 --ac selective --device h100
    twinshard plan --model path/to/config.json --world 1024 --hsdp 128 --impls optimized,torch
    twinshard plan --model small --world 8 --json plan.json --plot plan.png
    twinshard plan --model llama3-8b --world 64 --sweep world=8,64,512
    twinshard plan --model small --world 2 --device cpu --network simnet:ib --probe
    twinshard plan --model llama3-8b --world 8 --seq 8192 --device h100-500w --search

The job's flags (``--model``, ``--world``, ``--per-rank``, ...) are those of every measuring
command (``twinshard.measure.flags``);
one training step of the real code (the implementation's ``fully_shard`` with the policies
asked) runs as rank 0 of ``--world`` ranks on the fake accelerator, in a process of its own
(``runner.py``); the recorded step is timed with the device's and network's constants
(``profiles.py``) by replaying it over its streams and waits (``replay.py``). The job's ideal
step, the same model without FSDP (``ideal.py``), is recorded beside them, once per job, and
each implementation's FSDP overhead is its step minus the ideal. ``--device cpu``
plans this machine instead (``twinshard bench --backend simnet``'s rank, timed with constants
measured here). ``--search`` finds the fastest setting that fits (``search.py``). Every
argument is checked before any work starts (``config.problem``).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

from twinshard.commandline.report_files import publish
from twinshard.measure import allocator, flags, grid
from twinshard.measure.job import Job, positive

from . import config, profiles
from .ideal import job as ideal_job
from .ideal import seconds as ideal_seconds
from .summary import add_ideal, add_ratios, summarize
from .table import format_plan, plot_plan, plot_sweep

# --sweep NAME -> the job's field (layers: the model's n_layers), and the values' type
SWEEPABLE = {"world": "world", "per-rank": "per_rank", "seq": "seq", "hsdp": "replicas"}
SWEEPABLE |= {"ac": "ac", "layers": "n_layers", "batch": "per_rank"}  # batch: the old name
SWEEPABLE |= {"variants": "variants"}  # none: no variant


def add_arguments(parser: argparse.ArgumentParser) -> None:
    job = dict(model="small", impls="optimized,torch", world=8, hsdp=1, per_rank=1, seq=2048)
    flags.add(parser, *flags.JOB, "json", "markdown", "no_progress", **job, dtype="bf16")
    add = parser.add_argument
    add("--ac", default="none", help="activation checkpointing: none, block, layer:N, selective")
    add("--optimizer", default="adamw", help="adamw (fused) or sgd (momentum)")
    add("--device", default="h100", help=f"{', '.join(config.DEVICE_CHOICES)} (default h100)")
    add("--network", default=None, help=f"{', '.join(profiles.NETWORKS)} or simnet:<link>")
    add("--ranks-per-node", type=int, default=None, help="ranks sharing a node's link")
    add("--probe", action="store_true", help="also twinshard bench's memory categories")
    add("--sweep", default=None, help=f"NAME=V1,V2 with NAME one of {', '.join(SWEEPABLE)}")
    add("--plot", default=None, help="draw the memory timeline here (.png)")
    add("--search", action="store_true", help="the fastest setting that fits (search.py)")


def configs_from(args) -> tuple[list[list[Job]], str | None]:
    """The plans the command line asks for, one list per sweep point (one plan per
    implementation), and what is wrong with them (one line) or None."""
    own = dict(ac=args.ac, optimizer=args.optimizer, device=args.device, network=args.network)
    plans = flags.jobs(args, config.job, **own, probe=args.probe)
    axis, wrong = sweep_axis(args.sweep)
    if args.ranks_per_node is not None:
        wrong = positive("--ranks-per-node", args.ranks_per_node) or wrong
    points = [[grid.at(plan, point) for plan in plans] for point in grid.points(axis)]
    wrong = wrong or flags.problem([plan for row in points for plan in row], check=config.problem)
    try:
        allocator.max_split_of(os.environ)  # the allocator's setting the plan replays under
    except ValueError as error:
        wrong = wrong or str(error)
    return ([], wrong) if wrong else (points, None)


def sweep_axis(text: str | None) -> tuple[dict, str | None]:
    """``--sweep NAME=V1,V2``: the job's field (or model override) and its values."""
    if not text:
        return {}, None
    name, _, values = text.partition("=")
    if name not in SWEEPABLE or not values:
        return {}, f"--sweep takes NAME=V1,V2,... with NAME one of {', '.join(SWEEPABLE)}"
    kind = str if name in ("ac", "variants") else int
    if name == "variants":  # "none" is the plain collectives
        return {"variants": ["" if v == "none" else v for v in values.split(",")]}, None
    try:
        chosen = [kind(v) for v in values.split(",") if v]
    except ValueError:
        return {}, f"--sweep {name}: {values!r} is not a list of integers"
    return ({SWEEPABLE[name]: chosen} if chosen else {}), None


def device_and_network(plan: Job, ranks_per_node: int | None = None):
    """The constants that time ``plan``: a datasheet device and network, or this CPU."""
    if plan.cpu:
        link = (plan.network or "simnet:ib").partition(":")[2]
        return profiles.measure_cpu(), profiles.simulated_network(link, plan.world)
    name = plan.network or profiles.DEFAULT_NETWORK[plan.device]
    if name.startswith("simnet:"):
        network = profiles.simulated_network(name.partition(":")[2], plan.world)
    else:
        network = profiles.NETWORKS[name]
    if ranks_per_node:
        network = replace(network, ranks_per_node=ranks_per_node)
    return profiles.DEVICES[plan.device], network


def plan(plans: list[Job], progress: bool = True, ranks_per_node=None, ideal=True) -> list[dict]:
    """Record every plan (one spawned process) and summarize each; errors stay as rows.
    ``ideal`` (a bool, or a function of a job that says it for that job): also record each
    job's ideal step once (``ideal.py``) and add it to its rows."""
    from .runner import record_many

    wanted = ideal if callable(ideal) else (lambda _: ideal)
    ideals = {repr(ideal_job(job)): ideal_job(job) for job in plans if wanted(job)}
    recorded = record_many([*plans, *ideals.values()], progress)
    ideal_s = {}  # the ideal's seconds, or its error's last line
    for key, job, rec in zip(ideals, ideals.values(), recorded[len(plans) :]):
        if "error" in rec:
            ideal_s[key] = rec["error"].strip().splitlines()[-1]
        else:
            ideal_s[key] = ideal_seconds(summarize(rec, *device_and_network(job, ranks_per_node)))
    out = []
    for job, rec in zip(plans, recorded):
        if "error" not in rec:
            row = summarize(rec, *device_and_network(job, ranks_per_node))
            found = ideal_s.get(repr(ideal_job(job)))
            if isinstance(found, str):
                row["time"]["ideal_error"] = found
            elif found is not None:
                add_ideal(row, found)
            rec = {**row, "timeline": rec["timeline"]}
        out.append(rec)
    return out


def run(args) -> int:
    points, wrong = configs_from(args)
    if args.search and args.sweep:
        wrong = wrong or "--search and --sweep go one at a time"
    if wrong:
        print(f"twinshard plan: error: {wrong}", file=sys.stderr)
        return 2
    if args.search:
        return run_search(args, points[0][0])
    plans = [job for point in points for job in point]
    rows = plan(plans, not args.no_progress, args.ranks_per_node)
    in_order = iter(rows)  # one table per sweep point: implementation -> row
    by_point = [{job.impl: next(in_order) for job in point} for point in points]
    for by_impl in by_point:
        add_ratios(by_impl)
    slim = [{k: v for k, v in row.items() if k != "timeline"} for row in rows]
    texts = "\n\n".join(format_plan(by_impl) for by_impl in by_point)
    publish(texts, args.markdown, args.json, {"plans": slim})
    if args.plot and args.sweep:
        values = next(iter(sweep_axis(args.sweep)[0].values()), [])
        axis = args.sweep.partition("=")[0]
        plot_sweep(list(zip(values, by_point)), axis, args.plot)
        print(f"wrote {args.plot}")
    elif args.plot:
        last = by_point[-1]
        plot_plan(last, {n: r.get("timeline") for n, r in last.items()}, args.plot)
        print(f"wrote {args.plot}")
    return 1 if any("error" in row for row in rows) else 0


def run_search(args, base: Job) -> int:
    """``--search``: ``base``'s settings (its implementation, the first of ``--impls``)."""
    from . import search

    blocks = base.llama().n_layers
    progress = not args.no_progress
    plan_fn = lambda jobs, p, ideal: plan(jobs, p, args.ranks_per_node, ideal)  # noqa: E731
    found = search.search(base, blocks, plan_fn, progress)
    text = search.format_search(found, base, blocks)
    data = [
        {k: (search.describe(v) if k == "job" else v) for k, v in r.items() if k != "row"}
        for r in found["ranked"]
    ]
    publish(text, args.markdown, args.json, {"search": data})
    if args.plot:
        search.plot_search(found, args.plot)
        print(f"wrote {args.plot}")
    return 0 if found["best"] is not None else 1
