"""Side by side: plain, DDP, twinshard.reference, twinshard.optimized and torch's fully_shard.

    twinshard bench                                   # CPU, gloo, 2 ranks, 'small', all five
    twinshard bench --backend simnet --world 8 --link 2 --json out.json --plot out.png
    twinshard bench --backend fake --world 64 --hsdp 8 --preset small
    twinshard bench hooks                             # CPU time per group and step, profiled
    twinshard bench sweep --out benchmarks/results    # model size, groups, world size
    twinshard bench --device cuda --world 1 --preset 1b --dtype bf16
    twinshard bench --backend fakeaccel --world 64 --hsdp 8 --offload   # accelerator checks

Backends: ``gloo`` and ``nccl`` start one process per rank; ``fake`` (PyTorch's fake process
group: collectives do nothing) and ``simnet`` (a simulated network: collectives take latency +
bytes / bandwidth of ``--link``) run one process as rank 0 of a world of ``--world`` ranks, with
the shapes, memory and CPU work of that world. With ``simnet`` every implementation also runs on
an instant network, which gives its compute time and so its overlap efficiency. ``fakeaccel``
runs the sharded implementations on the fake accelerator instead (``twinshard.fakeaccel``): no
timings, but the host syncs, host tensors in collectives, collectives and device memory of
rank 0 of a ``--world``-rank accelerator job.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

import torch

from twinshard.report_files import publish, write_json

from . import checks, memmodel
from .config import BACKENDS, BASELINES, DTYPES, FAKEACCEL_RUNS, IMPLS, SHARDED, RunConfig
from .report import memory_table, meta, plot, table
from .runner import compare
from .stats import add_overlap, add_ratios, overlap_efficiency, summarize


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "mode",
        nargs="?",
        default="compare",
        choices=("compare", "hooks", "sweep"),
        help="compare (default): the implementations side by side; hooks: CPU time per group "
        "and step with tiny blocks, profiled; sweep: model size, groups and world size",
    )
    parser.add_argument(
        "--impls",
        default=None,
        help=f"comma-separated, of: {','.join(IMPLS)} or an importable module (my_pkg.my_fsdp)",
    )
    parser.add_argument("--preset", default=None, help="tiny, small, medium, 1b")
    parser.add_argument("--layers", type=int, default=None, help="blocks (groups), overrides")
    parser.add_argument("--dim", type=int, default=None, help="model width, overrides")
    parser.add_argument("--heads", type=int, default=None, help="attention heads, overrides")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary size, overrides")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence")
    parser.add_argument("--per-rank", type=int, default=None, help="sequences per rank per step")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--backend", choices=BACKENDS, default=None, help="gloo on cpu, nccl on cuda"
    )
    parser.add_argument("--world", "--nproc", type=int, default=None, help="world size")
    parser.add_argument("--hsdp", type=int, default=1, help="replicas of a 2D (HSDP) mesh")
    parser.add_argument("--link", default="ib", help="simnet: nvlink, ib, or GB/s")
    parser.add_argument("--latency-us", type=float, default=None, help="simnet: link latency")
    parser.add_argument(
        "--foreach",
        choices=("auto", "on", "off"),
        default=None,
        help="the optimizer's foreach: auto is torch's choice (a loop over the parameters on the "
        "CPU, multi-tensor operations on an accelerator); hooks mode defaults to on",
    )
    parser.add_argument("--offload", action="store_true", help="CPUOffloadPolicy, pinned")
    parser.add_argument(
        "--reshard-after-forward", default="true", help="of the blocks: true, false or an int"
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved repetitions")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory step")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--json", default=None, help="write every number here")
    parser.add_argument("--markdown", default=None, help="write the tables here")
    parser.add_argument("--plot", default=None, help="draw the comparison into this PNG")
    parser.add_argument("--from-json", default=None, help="show a recorded run (its --json)")
    parser.add_argument("--profile", default=None, help="hooks: write cProfile files here")
    parser.add_argument("--out", default="benchmarks/results", help="sweep: where plots go")
    parser.add_argument("--points", default=None, help="sweep: a smaller sweep, e.g. 'quick'")


# What each mode runs unless told otherwise (see the module docstring).
DEFAULTS = {
    "compare": dict(impls=",".join(IMPLS), preset="small", world=2, seq=128, per_rank=4, steps=10),
    # tiny blocks, so that compute is negligible and the hooks' own CPU time shows
    "hooks": dict(
        impls="plain,reference,optimized,torch",
        preset="tiny",
        layers=64,
        dim=32,
        heads=2,
        vocab=128,
        backend="fake",
        world=8,
        seq=8,
        per_rank=1,
        steps=40,
        # the optimizer as it runs on an accelerator, the setting this mode stands for:
        # multi-tensor operations, not the CPU's loop of DTensor dispatches per parameter
        foreach="on",
    ),
}


def resolve(args) -> None:
    """Fill what the command line left open with the defaults of ``args.mode``."""
    for name, value in DEFAULTS.get(args.mode, DEFAULTS["compare"]).items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def config_from(args) -> RunConfig:
    names = {"layers": "n_layers", "dim": "dim", "heads": "n_heads", "vocab": "vocab_size"}
    model = {key: getattr(args, flag) for flag, key in names.items() if getattr(args, flag)}
    if "n_heads" in model and "n_kv_heads" not in model:
        model["n_kv_heads"] = model["n_heads"]
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    same = "preset dtype seq per_rank warmup steps device world link latency_us profile".split()
    from twinshard.schedule.cli import reshard_value

    return RunConfig(
        model=model,
        backend=backend,
        replicas=args.hsdp,
        offload=args.offload,
        reshard_after_forward=reshard_value(args.reshard_after_forward),
        memory=not args.no_memory,
        foreach={"auto": None, "on": True, "off": False}[args.foreach or "auto"],
        **{name: getattr(args, name) for name in same},
    )


def side_by_side(
    base: RunConfig, impls: list[str], repeat: int, progress: bool = True, overlap: bool = True
) -> dict:
    """Run ``impls`` on ``base`` and summarize: figures, ratios, overlap (``simnet``: the same
    runs on an instant network too), memory model."""
    configs = [replace(base, impl=i) for i in impls]
    instant = []
    if overlap and base.backend == "simnet" and base.link != "inf":
        instant = [replace(c, link="inf", memory=False) for c in configs]
    runs = compare(configs + instant, repeat, progress)
    tokens = base.per_rank * base.seq * base.world
    summary = {c.impl: summarize(r, tokens) for c, r in zip(configs, runs)}
    add_ratios(summary)
    if instant:
        fast = {c.impl: summarize(r, tokens) for c, r in zip(instant, runs[len(configs) :])}
        add_overlap(summary, fast)
    if base.memory:
        add_memory_model(summary, base)
    return {"summary": summary, "runs": {c.impl: r for c, r in zip(configs, runs)}}


def add_memory_model(summary: dict, base: RunConfig) -> None:
    with torch.device("meta"):
        from twinshard.models import Llama

        groups = memmodel.groups_of(Llama(base.llama()))
    low = DTYPES[base.dtype] is not None
    pb, rb = (2, 4) if low else (4, 4)
    for name, row in summary.items():
        if name in SHARDED:
            gloo = base.backend == "gloo" and base.replicas == 1
            pred = memmodel.predict(groups, name, base.world // base.replicas, pb, rb, gloo)
        elif name in BASELINES:
            pred = memmodel.predict_replicated(groups, name, pb)
        else:
            continue  # a module from outside: the memory model knows twinshard's and torch's
        row["model"] = pred
        row["model_total"] = sum(pred.values())


def run(args) -> int:
    if not args.from_json:
        if args.mode != "sweep":  # the sweep fills its own defaults
            resolve(args)
        wrong = checks.problem(args)
        if wrong:
            print(f"twinshard bench: error: {wrong}", file=sys.stderr)
            return 2
    if args.mode == "hooks":
        from .hooks import run_hooks

        return run_hooks(args)
    if args.mode == "sweep":
        from .sweep import run_sweep

        return run_sweep(args)
    if args.from_json:
        return rerender(args)
    resolve(args)
    base = config_from(args)
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    if base.backend == "fakeaccel":
        return fake_accelerator(base, impls, args)
    result = side_by_side(base, impls, args.repeat, not args.no_progress)
    if args.json:
        write_json(args.json, {"meta": meta(base.as_dict()), **result})
    show(base, result["summary"], args)
    return 0


def fake_accelerator(base: RunConfig, impls: list[str], args) -> int:
    """``--backend fakeaccel``: the sharded implementations among ``impls`` on the fake
    accelerator (``twinshard.fakeaccel``), two steps each, and its report."""
    from twinshard.fakeaccel.cli import check_and_report

    sharded = [i for i in impls if i not in BASELINES]
    if not sharded:
        print(FAKEACCEL_RUNS, file=sys.stderr)
        return 2
    configs = [replace(base, impl=i, device="cpu") for i in sharded]
    options = argparse.Namespace(
        steps=2, no_cpu=False, device="fake", json=args.json, markdown=args.markdown
    )
    return check_and_report(configs, options)


def show(base: RunConfig, summary: dict, args) -> None:
    """Print the tables; write them (``--markdown``) and the plot (``--plot``) if asked."""
    text = describe(base) + "\n\n" + table(summary)
    if base.memory:
        text += "\n\nMemory at the peak (bytes alive by category; model = memmodel.predict)\n\n"
        text += memory_table(summary)
    publish(text, args.markdown)
    if args.plot:
        plot(summary, args.plot, describe(base))


def rerender(args) -> int:
    """``--from-json FILE``: the tables and plot of a recorded run, without running it again
    (the memory model and the overlap formula are applied anew)."""
    with open(args.from_json) as f:
        recorded = json.load(f)
    base = RunConfig(**recorded["meta"]["config"])
    if base.memory:
        add_memory_model(recorded["summary"], base)
    for row in recorded["summary"].values():
        if "compute_s" in row:
            keys = ("compute_s", "comm_s", "step_s", "first_all_gather_s", "last_reduce_scatter_s")
            row["overlap_efficiency"] = overlap_efficiency(*(row[k] for k in keys))
    show(base, recorded["summary"], args)
    if args.json:
        write_json(args.json, recorded)
    return 0


def describe(config: RunConfig) -> str:
    cfg = config.llama()
    mesh = f"{config.replicas}x{config.world // config.replicas}" if config.replicas > 1 else ""
    link = f", link {config.link}" if config.backend == "simnet" else ""
    return (
        f"{config.backend} world {mesh or config.world}{link}, {config.device}, {config.dtype}; "
        f"Llama {config.preset} (dim {cfg.dim}, {cfg.n_layers} blocks, vocab {cfg.vocab_size}), "
        f"{config.per_rank} x {config.seq} tokens per rank, {config.steps} steps x repeats"
    )
