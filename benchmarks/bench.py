"""Side by side: the plain model, twinshard.reference, twinshard.optimized and torch's fully_shard.

    python benchmarks/bench.py                                  # CPU, gloo, 2 ranks, 'small'
    python benchmarks/bench.py --device cuda --nproc 1 --preset 1b --dtype bf16 --trace out/

Every implementation trains the same Llama-style model (same seed) on the same batches, in a
fresh process group of its own, so that one run's memory does not count against the next.
Per implementation: median step time over the timed steps (after warm-up) and peak memory
(CPU: peak resident memory above what the process held before building the model;
accelerator: torch's peak allocated bytes). The table gives both as ratios to the plain model
and to the reference. ``--trace DIR`` writes a profiler trace of the optimized run (chrome
format), where the next group's all-gather can be seen running during the current group's
compute. ``--json FILE`` saves the numbers.

The plain model is the same network without FSDP: each rank trains a full replica on its own
slice and nothing is communicated, so it is the compute floor, not a data-parallel baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

from twinshard.launch import launch
from twinshard.models import Llama, LlamaConfig

IMPLS = {
    "plain": None,
    "reference": "twinshard.reference",
    "optimized": "twinshard.optimized",
    "torch": "torch.distributed.fsdp",
}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_one(impl_name, preset, dtype, seq, per_rank, warmup, steps, trace_dir):
    import importlib

    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    base_rss = _rss_mb()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    cfg = LlamaConfig.preset(preset, max_seq_len=max(seq, 16))
    low = {"bf16": torch.bfloat16, "fp32": None}[dtype]
    if impl_name is None:
        model = Llama(cfg).to(device)
        if low is not None:
            model = model.to(low)  # compute in bf16 like the sharded runs (no fp32 master)
    else:
        impl = importlib.import_module(impl_name)
        model = Llama(cfg)
        kwargs = {}
        if low is not None:
            kwargs["mp_policy"] = impl.MixedPrecisionPolicy(
                param_dtype=low, reduce_dtype=torch.float32
            )
        for block in model.blocks:
            impl.fully_shard(block, **kwargs)
        impl.fully_shard(model, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    times = []
    prof = None
    for step in range(warmup + steps):
        tokens = torch.randint(0, cfg.vocab_size, (per_rank * world, seq + 1), generator=g)
        tokens = tokens[rank * per_rank : (rank + 1) * per_rank].to(device)
        if trace_dir and impl_name == IMPLS["optimized"] and step == warmup and rank == 0:
            prof = torch.profiler.profile(activities=_activities(cuda))
            prof.__enter__()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
        if prof is not None and step == warmup:
            prof.__exit__(None, None, None)
            os.makedirs(trace_dir, exist_ok=True)
            prof.export_chrome_trace(os.path.join(trace_dir, "optimized_trace.json"))
            prof = None
    peak = (
        torch.cuda.max_memory_allocated() / 2**20
        if cuda
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base_rss
    )
    return {
        "step_s": statistics.median(times),
        "peak_mb": peak,
        "loss": loss.item(),
        "params": sum(p.numel() for p in model.parameters()),
    }


def _activities(cuda):
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--per-rank", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=1, help="run the whole comparison N times")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--trace", default=None, help="directory for the optimized run's trace")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    backend = "nccl" if args.device == "cuda" else "gloo"
    rows = {name: [] for name in args.impls.split(",")}
    for _ in range(args.repeat):
        for name in rows:
            res = launch(
                run_one,
                args.nproc,
                IMPLS[name],
                args.preset,
                args.dtype,
                args.seq,
                args.per_rank,
                args.warmup,
                args.steps,
                args.trace,
                backend=backend,
                timeout=1800,
            )
            rows[name].append(
                {
                    "step_s": statistics.median(r["step_s"] for r in res),
                    "peak_mb": max(r["peak_mb"] for r in res),
                    "loss": res[0]["loss"],
                    "params": res[0]["params"],
                }
            )
            print(
                f"  {name:10s} step {rows[name][-1]['step_s'] * 1000:8.1f} ms  "
                f"peak {rows[name][-1]['peak_mb']:8.1f} MB",
                flush=True,
            )
    summary = {
        n: {
            "step_s": statistics.median(r["step_s"] for r in v),
            "peak_mb": statistics.median(r["peak_mb"] for r in v),
        }
        for n, v in rows.items()
    }
    print(table(summary))
    if args.json:
        meta = {
            "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(["python"] + sys.argv),
            "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "device": args.device,
            "nproc": args.nproc,
            "preset": args.preset,
            "dtype": args.dtype,
            "seq": args.seq,
            "per_rank": args.per_rank,
            "steps": args.steps,
            "repeat": args.repeat,
        }
        if args.device == "cuda":
            meta["gpu"] = torch.cuda.get_device_name(0)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "summary": summary, "runs": rows}, f, indent=1)
    return 0


def table(summary: dict) -> str:
    plain = summary.get("plain")
    ref = summary.get("reference")
    lines = [
        "| impl | step (ms) | vs plain | vs reference | peak (MB) | mem vs reference |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in summary.items():
        vs_plain = f"{r['step_s'] / plain['step_s']:.2f}x" if plain else "-"
        vs_ref = f"{r['step_s'] / ref['step_s']:.2f}x" if ref else "-"
        mem_ref = f"{r['peak_mb'] / ref['peak_mb']:.2f}x" if ref and ref["peak_mb"] > 0 else "-"
        lines.append(
            f"| {name} | {r['step_s'] * 1000:.1f} | {vs_plain} | {vs_ref} | "
            f"{r['peak_mb']:.1f} | {mem_ref} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
