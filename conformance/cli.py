"""Check an FSDP implementation against the plain model, the reference and torch's fully_shard.

    twinshard conform twinshard.reference
    twinshard conform my_pkg.my_fsdp --world-sizes 1,2,3,2x2 --cases 'bf16_*,trace_*'
    twinshard conform torch.distributed.fsdp --report conformance.md

MODULE is any importable module with the fully_shard interface (fully_shard, the policies,
FSDPModule, register_fsdp_forward_method). The exit status is 1 when a case fails or an
expected failure passes, 0 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .cases import CASES
from .suite import (
    DEFAULT_MESHES,
    apply_xfail,
    default_xfail,
    failed,
    load_xfail,
    parse_meshes,
    report,
    run_suite,
)

REQUIRED = (
    "fully_shard",
    "MixedPrecisionPolicy",
    "CPUOffloadPolicy",
    "FSDPModule",
    "register_fsdp_forward_method",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "module", nargs="?", help="importable module providing the fully_shard interface"
    )
    parser.add_argument(
        "--world-sizes",
        default=DEFAULT_MESHES,
        help=f"meshes to run: world sizes, or RxS for HSDP (default {DEFAULT_MESHES})",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo ranks; cuda: NCCL, one rank per GPU",
    )
    parser.add_argument(
        "--cases", default=None, help="comma-separated shell patterns of case names (default: all)"
    )
    parser.add_argument(
        "--xfail", default=None, help="expected-failures file (lines 'CASE[@MESH]: reason')"
    )
    parser.add_argument(
        "--report",
        default=None,
        help="also write the report here: .md for markdown, .json for JSON",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds a mesh may take before its ranks are stopped",
    )
    parser.add_argument(
        "--stand-in-streams",
        action="store_true",
        help="run the accelerator schedule on the CPU with stand-in streams and "
        "check every tensor access against their order (for twinshard."
        "optimized and variants built on its streams)",
    )
    parser.add_argument(
        "--no-oracles",
        action="store_true",
        help="compare with the plain model only, not with twinshard.reference "
        "and torch's fully_shard (faster)",
    )
    parser.add_argument("--list", action="store_true", help="list the cases and exit")


def check_module(name: str) -> None:
    """Fail early, in the parent, if MODULE cannot be imported or lacks the interface."""
    try:
        module = importlib.import_module(name)
    except ImportError as error:
        raise SystemExit(f"twinshard conform: cannot import {name!r}: {error}") from None
    missing = [attr for attr in REQUIRED if not hasattr(module, attr)]
    if missing:
        raise SystemExit(
            f"twinshard conform: {name!r} lacks {', '.join(missing)}; it must "
            "provide the fully_shard interface (see twinshard.api)"
        )


def run(args: argparse.Namespace) -> int:
    if args.list:
        for name, case in CASES.items():
            print(f"{name:32s} {case.group:16s} {case.doc.splitlines()[0] if case.doc else ''}")
        return 0
    if not args.module:
        raise SystemExit(
            "twinshard conform: name the implementation module to check "
            "(e.g. twinshard.reference); --list shows the cases"
        )
    check_module(args.module)
    try:
        meshes = parse_meshes(args.world_sizes)
        patterns = args.cases.split(",") if args.cases else None
        xfail_path = args.xfail or default_xfail(args.module)
        expected = load_xfail(xfail_path)
    except (ValueError, OSError) as error:
        raise SystemExit(f"twinshard conform: {error}") from None
    print(
        f"twinshard conform {args.module} on {args.device}, meshes "
        f"{', '.join('x'.join(map(str, m)) for m in meshes)}"
        + (f", expected failures from {xfail_path}" if xfail_path else ""),
        flush=True,
    )

    def progress(shape, rows):
        bad = [r["case"] for r in rows if r["status"] == "FAIL"]
        skipped = sum(r["status"] == "SKIP" for r in rows)
        print(
            f"  mesh {'x'.join(map(str, shape))}: {len(rows) - skipped} cases run, {skipped} "
            f"skipped, {len(bad)} failed{': ' + ', '.join(bad) if bad else ''}",
            flush=True,
        )

    rows = run_suite(
        args.module,
        meshes,
        patterns,
        args.device,
        args.timeout,
        progress=progress,
        stand_in_streams=args.stand_in_streams,
        oracles=not args.no_oracles,
    )
    if not rows:
        raise SystemExit("twinshard conform: no case applies to the selected meshes and patterns")
    rows = apply_xfail(rows, expected)
    print(report(rows, args.module))
    for r in rows:
        if r["status"] in ("FAIL", "XPASS"):
            print(f"--- {r['case']} on {r['mesh']}: {r['status']}")
            for line in (r["failures"] or [r["reason"]])[:5]:
                print("   ", line.strip()[-2000:])
    if args.report:
        fmt = "json" if args.report.endswith(".json") else "markdown"
        with open(args.report, "w") as f:
            f.write(report(rows, args.module, fmt))
    return 1 if failed(rows) else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="twinshard conform", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
