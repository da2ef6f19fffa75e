"""Plan a training job from this CPU: memory, communication and predicted time, per rank.

    twinshard plan --model llama3-8b --world 64 --seq 8192 --ac selective --device h100
    twinshard plan --model path/to/config.json --world 1024 --hsdp 128 --impls optimized,torch
    twinshard plan --model small --world 8 --json plan.json --plot plan.png
    twinshard plan --model llama3-8b --world 64 --sweep world=8,64,512
    twinshard plan --model small --world 2 --device cpu --network simnet:ib --probe

One training step of the real code (the implementation's ``fully_shard`` with the policies
asked) runs as rank 0 of ``--world`` ranks on the fake accelerator, in a process of its own
(``runner.py``); the recorded step is timed with the device's and network's constants
(``profiles.py``) by replaying it over its streams and waits (``replay.py``). ``--device cpu``
plans this machine instead (``twinshard bench --backend simnet``'s rank, timed with constants
measured here). Every argument is checked before any work starts (``config.PlanConfig.check``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from twinshard.bench.checks import parse_reshard
from twinshard.impls import names
from twinshard.report_files import publish

from . import profiles
from .config import DEVICE_CHOICES, PlanConfig
from .summary import add_ratios, summarize
from .table import format_plan, plot_plan, plot_sweep

SWEEPABLE = {"world": int, "batch": int, "seq": int, "hsdp": int, "ac": str, "layers": int}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default="small", help="a preset, llama3-8b/70b/405b, llama2-*, or a config.json")
    add("--layers", type=int, default=None, help="blocks, overriding the model's")
    add(
        "--impls",
        default="optimized,torch",
        help="comma-separated: reference, optimized, torch or an importable module (my_pkg.my_fsdp)",
    )
    add("--world", type=int, default=8, help="ranks (default 8)")
    add("--hsdp", type=int, default=1, help="replicas of an HSDP mesh (default 1: FSDP)")
    add("--batch", type=int, default=1, help="sequences per rank per step (default 1)")
    add("--seq", type=int, default=2048, help="tokens per sequence (default 2048)")
    add("--dtype", default="bf16", help="bf16 (fp32 reduction) or fp32")
    add("--ac", default="none", help="activation checkpointing: none, block, layer:N, selective")
    add("--reshard-after-forward", default="true", help="of the blocks: true, false or an int")
    add("--offload", action="store_true", help="CPUOffloadPolicy: shards and states on the host")
    add("--optimizer", default="adamw", help="adamw (fused) or sgd (momentum)")
    add("--device", default="h100", help=f"{', '.join(DEVICE_CHOICES)} (default h100)")
    add("--network", default=None, help=f"{', '.join(profiles.NETWORKS)} or simnet:<link>")
    add("--ranks-per-node", type=int, default=None, help="ranks sharing a node's link")
    add("--probe", action="store_true", help="also twinshard bench's memory categories")
    add("--sweep", default=None, help="one of world, batch, seq, hsdp, ac, layers: NAME=V1,V2")
    add("--json", default=None, help="write the plan here")
    add("--markdown", default=None, help="write the table here")
    add("--plot", default=None, help="draw the memory timeline here (.png)")
    add("--no-progress", action="store_true")


def configs_from(args) -> tuple[list[PlanConfig], str | None]:
    """The plans the command line asks for, and what is wrong with them (one line) or None."""
    try:
        reshard = parse_reshard(args.reshard_after_forward)
    except ValueError as error:
        return [], str(error)
    impls = names(args.impls) or [""]
    base = PlanConfig(
        model=args.model,
        layers=args.layers,
        world=args.world,
        hsdp=args.hsdp,
        batch=args.batch,
        seq=args.seq,
        dtype=args.dtype,
        ac=args.ac,
        reshard_after_forward=reshard,
        offload=args.offload,
        optimizer=args.optimizer,
        device=args.device,
        network=args.network,
        probe=args.probe,
    )
    if args.ranks_per_node is not None and args.ranks_per_node < 1:
        return [], f"--ranks-per-node must be a positive integer, got {args.ranks_per_node}"
    points, wrong = sweep_points(args.sweep)
    if wrong:
        return [], wrong
    configs = [replace(base, impl=impl, **point) for point in points or [{}] for impl in impls]
    for config in configs:
        wrong = config.check()
        if wrong:
            return [], wrong
    return configs, None


def sweep_points(text: str | None) -> tuple[list[dict], str | None]:
    """``--sweep NAME=V1,V2``: one override per value."""
    if not text:
        return [], None
    name, _, values = text.partition("=")
    if name not in SWEEPABLE or not values:
        return [], f"--sweep takes NAME=V1,V2,... with NAME one of {', '.join(SWEEPABLE)}"
    try:
        return [{name: SWEEPABLE[name](v)} for v in values.split(",") if v], None
    except ValueError:
        return [], f"--sweep {name}: {values!r} is not a list of integers"


def device_and_network(config: PlanConfig, ranks_per_node: int | None = None):
    """The constants that time ``config``: a datasheet device and network, or this CPU."""
    if config.cpu:
        device = profiles.measure_cpu()
        link = (config.network or "simnet:ib").partition(":")[2]
        return device, profiles.simulated_network(link, config.world)
    name = config.network
    if name is None or name.startswith("simnet:"):
        network = (
            profiles.simulated_network(name.partition(":")[2], config.world)
            if name
            else profiles.NETWORKS[profiles.DEFAULT_NETWORK[config.device]]
        )
    else:
        network = profiles.NETWORKS[name]
    if ranks_per_node:
        network = replace(network, ranks_per_node=ranks_per_node)
    return profiles.DEVICES[config.device], network


def plan(configs: list[PlanConfig], progress: bool = True, ranks_per_node=None) -> list[dict]:
    """Record every config (one spawned process) and summarize each; errors stay as rows."""
    from .runner import record_many

    recorded = record_many(configs, progress)
    out = []
    for config, rec in zip(configs, recorded):
        if "error" in rec:
            out.append(rec)
            continue
        device, network = device_and_network(config, ranks_per_node)
        row = summarize(rec, device, network)
        row["timeline"] = rec["timeline"]
        out.append(row)
    return out


def run(args) -> int:
    configs, wrong = configs_from(args)
    if wrong:
        print(f"twinshard plan: error: {wrong}", file=sys.stderr)
        return 2
    rows = plan(configs, not args.no_progress, args.ranks_per_node)
    groups: dict = {}  # one table per sweep point
    for config, row in zip(configs, rows):
        point = json.dumps(
            {k: v for k, v in config.as_dict().items() if k != "impl"}, sort_keys=True
        )
        groups.setdefault(point, {})[config.impl] = row
    texts = []
    for by_impl in groups.values():
        add_ratios(by_impl)
        texts.append(format_plan(by_impl))
    text = "\n\n".join(texts)
    slim = [{k: v for k, v in row.items() if k != "timeline"} for row in rows]
    publish(text, args.markdown, args.json, {"plans": slim})
    if args.plot and args.sweep:
        axis = args.sweep.partition("=")[0]
        points = [(json.loads(key)[axis], rows) for key, rows in groups.items()]
        plot_sweep(points, axis, args.plot)
        print(f"wrote {args.plot}")
    elif args.plot:
        last = list(groups.values())[-1]
        plot_plan(last, {n: r.get("timeline") for n, r in last.items()}, args.plot)
        print(f"wrote {args.plot}")
    return 1 if any("error" in row for row in rows) else 0
