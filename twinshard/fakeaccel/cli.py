"""The fake-accelerator run from the command line: a W-rank accelerator job, checked on the CPU.

    python -m twinshard.fakeaccel                              # W = 8, tiny Llama, bf16, all three
    python -m twinshard.fakeaccel --world 64 --hsdp 8 --offload --reshard-after-forward 4
    python -m twinshard.fakeaccel --impls optimized --world 1024 --json out.json
    twinshard bench --backend fakeaccel --world 64             # the same, from twinshard bench
    python -m twinshard.fakeaccel --device cuda                # the same checks on a real GPU

Each implementation (``--impls``: reference, optimized, torch or a module path) trains
``--steps`` steps on the fake accelerator in one spawned process, which plays rank 0 of
``--world`` ranks; the report gives per configuration the host syncs, the explicit syncs, the
collectives with host tensors, the collectives (and whether they equal the CPU run's), the peak
bytes on the device and the memory model beside what FSDP holds (see ``report.py``). The exit
status is 1 if any configuration failed, synced the host, sent a host tensor to a collective or
issued other collectives than the CPU run.
"""

from __future__ import annotations

import argparse

from twinshard import impls
from twinshard.bench.config import DTYPES, SHARDED, RunConfig
from twinshard.report_files import publish
from twinshard.schedule.cli import reshard_value

from . import report
from .runner import STEPS
from .runner import run as run_checks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--impls",
        default=",".join(SHARDED),
        help="of: " + ", ".join(SHARDED) + " or an importable module (my_pkg.my_fsdp)",
    )
    parser.add_argument("--world", type=int, default=8, help="ranks this process plays one of")
    parser.add_argument("--hsdp", type=int, default=1, help="replicas of a 2D (HSDP) mesh")
    parser.add_argument("--preset", default="tiny", help="tiny, small, medium, 1b")
    parser.add_argument("--layers", type=int, default=None, help="blocks (groups), overrides")
    parser.add_argument("--dim", type=int, default=None, help="model width, overrides")
    parser.add_argument("--seq", type=int, default=16, help="tokens per sequence")
    parser.add_argument("--per-rank", type=int, default=2, help="sequences per rank per step")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--offload", action="store_true", help="CPUOffloadPolicy (pinned)")
    parser.add_argument(
        "--reshard-after-forward", default="true", help="of the blocks: true, false or an int"
    )
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps per run")
    parser.add_argument("--no-cpu", action="store_true", help="skip the CPU run's collectives")
    parser.add_argument(
        "--device",
        default="fake",
        help="fake (the fake accelerator, default) or a real device type such as cuda",
    )
    parser.add_argument("--json", default=None, help="write every result here")
    parser.add_argument("--markdown", default=None, help="write the report here")


def configs_from(args) -> list[RunConfig]:
    model = {k: v for k, v in (("n_layers", args.layers), ("dim", args.dim)) if v}
    wrong = impls.problem(args.impls, "--impls")
    if wrong:
        raise SystemExit(wrong)
    if args.world % args.hsdp:
        raise SystemExit(f"--hsdp {args.hsdp} does not divide --world {args.world}")
    return [
        RunConfig(
            impl=impl,
            preset=args.preset,
            model=model,
            dtype=args.dtype,
            seq=args.seq,
            per_rank=args.per_rank,
            backend="fakeaccel",
            world=args.world,
            replicas=args.hsdp,
            offload=args.offload,
            reshard_after_forward=reshard_value(args.reshard_after_forward),
        )
        for impl in impls.names(args.impls)
    ]


def check_and_report(configs: list[RunConfig], args) -> int:
    """Run ``configs``, print the report (and write it where asked); 1 if any is not clean."""
    results = run_checks(configs, steps=args.steps, cpu=not args.no_cpu, on=args.device)
    first = configs[0]
    cfg = first.llama()
    where = "fake accelerator" if args.device == "fake" else f"device {args.device}"
    title = (
        f"{where}, rank 0 of {report.mesh_label(first.as_dict())}; Llama {first.preset} (dim "
        f"{cfg.dim}, {cfg.n_layers} blocks, vocab {cfg.vocab_size}), {first.per_rank} x "
        f"{first.seq} tokens per rank; figures of step {args.steps} of {args.steps}"
    )
    text = report.render(results, title)
    publish(text, args.markdown, args.json, {"title": title, "results": results})
    return 0 if all(clean(r) for r in results) else 1


def clean(result: dict) -> bool:
    """No failure, host sync, host collective or difference from the CPU run in any step."""
    if "error" in result or "cpu_error" in result or result.get("collective_difference"):
        return False
    return all(s["host_syncs"] == 0 and s["host_collectives"] == 0 for s in result["steps"])


def run(args) -> int:
    return check_and_report(configs_from(args), args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m twinshard.fakeaccel", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
