"""Fuzzed parity, at length: many random examples, reference and optimized against the plain model.

    python benchmarks/fuzz_parity.py --examples 2000            # every mesh, seed 0
    python benchmarks/fuzz_parity.py --examples 300 --meshes 4,2x2 --seed 7
    python benchmarks/fuzz_parity.py --examples 540 --stand-in-streams --seed 23   # sanitized
    python benchmarks/fuzz_parity.py --replay '{"mesh":[2],...}'   # one example, as printed

``--stand-in-streams`` runs the optimized path of every example on stand-in streams with the
stream sanitizer on (``Example.stand_in``): a race or an early release fails the example with
the sanitizer's report (``StreamOrderError: ...``), beside the usual comparisons.

CI runs a few dozen of the same examples (``tests/suite/test_fuzz_parity.py``); this script draws as
many as asked with ``twinshard.conformance.fuzz_draw`` (the same for the same seed), splits them
by mesh, and runs each mesh's examples in batches of ``--batch`` inside one process group. A
batch whose ranks crash or hang (a ``LaunchError``) is run again one example per launch, so that
the failure is pinned on an example. Every failure is printed as one JSON line that
``--replay`` runs again, and written to ``--out``; each one belongs in
``tests/suite/test_fuzz_parity.py``'s ``REGRESSIONS``, with a fix.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from twinshard.conformance.fuzz import Example, run_examples
from twinshard.conformance.suite import mesh_name, parse_meshes
from twinshard.ranks.launch import LaunchError, launch

MESHES = "1,2,3,4,2x2,1x2,2x1,1x3,3x1"
RAISED = "RuntimeError: example "  # how run_examples reports an example that raised


def run_batch(examples: list[Example], mesh: tuple, timeout: float) -> list[dict]:
    """Verdicts for ``examples`` on ``mesh``: one launch, or one per example if that crashes."""
    texts = [e.to_json() for e in examples]
    try:
        return launch(run_examples, math.prod(mesh), texts, mesh, timeout=timeout)[0]
    except LaunchError as error:
        if len(texts) == 1:  # what each rank raised (a StreamOrderError's report), then the end
            text = str(error)
            raised = list(
                dict.fromkeys(  # once each: a rank's traceback repeats its message
                    "raised " + line.split(" raised ", 1)[-1]
                    for line in text.splitlines()
                    if line.startswith(RAISED)
                )
            )
            return [{"ok": False, "example": texts[0], "failures": raised + [text[-3000:]]}]
    return [v for e in examples for v in run_batch([e], mesh, timeout)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--examples", type=int, default=200, help="how many to draw (default 200)")
    p.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    p.add_argument("--meshes", default=MESHES, help=f"world sizes or RxS (default {MESHES})")
    p.add_argument("--batch", type=int, default=25, help="examples per process group")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per batch")
    p.add_argument("--out", default="fuzz-failures.jsonl", help="failures, one JSON line each")
    p.add_argument(
        "--stand-in-streams",
        action="store_true",
        help="the optimized path on stand-in streams, under the stream sanitizer",
    )
    p.add_argument("--replay", metavar="JSON", help="run this one example (as printed)")
    args = p.parse_args(argv)
    from twinshard.conformance.fuzz_draw import draw

    if args.replay:
        plan = {tuple(Example.from_json(args.replay).mesh): [Example.from_json(args.replay)]}
    else:
        meshes = parse_meshes(args.meshes)
        per_mesh = [args.examples // len(meshes)] * len(meshes)
        for i in range(args.examples % len(meshes)):
            per_mesh[i] += 1
        plan = {
            m: draw(n, args.seed + i, m, args.stand_in_streams)
            for i, (m, n) in enumerate(zip(meshes, per_mesh))
            if n
        }
    start, ran, failed = time.perf_counter(), 0, []
    for mesh, examples in plan.items():
        for i in range(0, len(examples), args.batch):
            batch = examples[i : i + args.batch]
            verdicts = run_batch(batch, mesh, args.timeout)
            ran += len(verdicts)
            for v in verdicts:
                if not v["ok"]:
                    failed.append(v)
                    print(
                        f"FAIL {v['example']}\n  " + "\n  ".join(x[:400] for x in v["failures"][:5])
                    )
            print(
                f"mesh {mesh_name(mesh)}: {ran} run, {len(failed)} failed, "
                f"{time.perf_counter() - start:.0f} s",
                flush=True,
            )
    with open(args.out, "w") as f:
        for v in failed:
            f.write(json.dumps({"example": v["example"], "failures": v["failures"][:5]}) + "\n")
    sanitized = sum(e.stand_in for examples in plan.values() for e in examples)
    print(
        f"\n{ran} examples ({sanitized} on stand-in streams, sanitized) on meshes "
        f"{', '.join(map(mesh_name, plan))}{'' if args.replay else f', seed {args.seed}'}: "
        f"{len(failed)} failed, "
        f"{time.perf_counter() - start:.0f} s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
