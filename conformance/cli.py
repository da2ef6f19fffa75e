"""Check an FSDP implementation against the plain model, the reference and torch's fully_shard.

    twinshard conform twinshard.reference
    twinshard conform my_pkg.my_fsdp --world-sizes 1,2,3,2x2 --cases 'bf16_*,trace_*'
    twinshard conform torch.distributed.fsdp --report conformance.md

MODULE is any importable module with the fully_shard interface (fully_shard, the policies,
FSDPModule, register_fsdp_forward_method), or a short name: reference, optimized, torch
(``twinshard.commandline.impls``). The exit status is 1 when a case fails or an expected
failure passes, 0 otherwise. Every argument is checked before a rank starts (the module imports
and has the interface, meshes, case patterns, the expected-failures file, the timeout, enough
GPUs for ``--device cuda``, a writable ``--report``); a bad one ends the command with one line
and status 2.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile

from twinshard.commandline import impls

from .cases import CASES
from .lossy import load_variant
from .runner import select
from .suite import (
    DEFAULT_MESHES,
    LOSSY_MESHES,
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
        "module",
        nargs="?",
        help="importable module providing the fully_shard interface, or reference, optimized, "
        "torch",
    )
    parser.add_argument(
        "--world-sizes",
        default=None,
        help=f"meshes to run: world sizes, or RxS for HSDP (default {DEFAULT_MESHES}; "
        f"{LOSSY_MESHES} for lossy cases alone or with --variant)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo ranks; cuda: NCCL, one rank per GPU (an error when a mesh needs "
        "more GPUs than there are, unless --skip-missing-gpus)",
    )
    parser.add_argument(
        "--skip-missing-gpus",
        action="store_true",
        help="with --device cuda, report the meshes that need more GPUs than there are as "
        "SKIP instead of refusing to run",
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
    parser.add_argument(
        "--variant",
        default=None,
        help="a communication variant for the lossy_given case: MY_MODULE:NAME (see "
        "docs/variants.md) or built-ins as --variants spells them (qwz+qgz:node=2)",
    )
    parser.add_argument("--list", action="store_true", help="list the cases and exit")


def refuse(message: str) -> SystemExit:
    """Say what is wrong in one line; the caller raises the result (exit status 2)."""
    print(f"twinshard conform: {message}", file=sys.stderr)
    return SystemExit(2)


def check_module(name: str) -> None:
    """Fail early, in the parent, if MODULE cannot be imported or lacks the interface (by
    ``twinshard.commandline.impls``, as every command resolves an implementation)."""
    try:
        impls.load(name, needs=REQUIRED)
    except impls.ImplError as error:
        raise refuse(str(error)) from None


def run(args: argparse.Namespace) -> int:
    if args.list:
        for name, case in CASES.items():
            print(f"{name:32s} {case.group:16s} {case.doc.splitlines()[0] if case.doc else ''}")
        return 0
    if not args.module:
        raise refuse(
            "name the implementation module to check "
            "(e.g. twinshard.reference); --list shows the cases"
        )
    args.module = impls.module_name(args.module)  # a short name: reference, optimized, torch
    check_module(args.module)
    if args.world_sizes is None:  # lossy cases alone, or a variant given: 4 ranks too
        lossy = args.variant or (
            args.cases and all(c.startswith("lossy") for c in args.cases.split(","))
        )
        args.world_sizes = LOSSY_MESHES if lossy else DEFAULT_MESHES
    try:
        meshes = parse_meshes(args.world_sizes)
        patterns = args.cases.split(",") if args.cases else None
        select(patterns)  # no case matches: say so now
        xfail_path = args.xfail or default_xfail(args.module)
        expected = load_xfail(xfail_path)
        if args.variant:
            load_variant(args.variant)  # importable, and a variant: say so now
    except (ValueError, OSError) as error:
        raise refuse(f"{error}") from None
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        raise refuse(f"--timeout must be positive, got {args.timeout}")
    check_gpus(args.device, meshes, args.skip_missing_gpus)
    if args.report:
        check_writable(args.report)
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
        variant=args.variant,
    )
    if not rows:
        raise refuse("no case applies to the selected meshes and patterns")
    rows = apply_xfail(rows, expected)
    print(report(rows, args.module))
    warned = {n for r in rows for n in r.get("notes", []) if n.startswith("warning:")}
    for note in sorted(warned):  # said once, whatever the mesh or rank
        print(note)
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


def check_gpus(device: str, meshes: list, skip: bool) -> None:
    """With --device cuda, refuse meshes that need more GPUs than there are (a CI job must not
    pass having checked nothing), unless told to skip them."""
    if device != "cuda" or skip:
        return
    import torch

    gpus = torch.cuda.device_count()
    short = [m for m in meshes if math.prod(m) > gpus]
    if short:
        names = ", ".join("x".join(map(str, m)) for m in short)
        raise refuse(
            f"--device cuda but {gpus} GPU(s) here, and mesh(es) {names} "
            f"need more; choose --world-sizes that fit, --device cpu, or --skip-missing-gpus "
            "to report them as skipped"
        )


def check_writable(path: str) -> None:
    """Refuse a --report that cannot be written, before the suite runs."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise refuse(f"--report {path} is a directory; name a file")
    try:
        tempfile.TemporaryFile(dir=folder).close()  # the one sure test, for root too
        if os.path.exists(path) and not os.access(path, os.W_OK):
            raise PermissionError(f"{path} is not writable")
    except OSError as error:
        raise refuse(f"cannot write --report {path}: {error.strerror or error}") from None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="twinshard conform", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
