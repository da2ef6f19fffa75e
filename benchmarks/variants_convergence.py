"""Issue 35's convergence target: a lossy variant trains as well as the exact collectives.

    python benchmarks/variants_convergence.py                     # 500 steps, three impls
    python benchmarks/variants_convergence.py --steps 100 --impls optimized --out /tmp/r

Each implementation (torch's ``fully_shard``, the reference, the optimized path) trains
``twinshard train``'s default model (the ``tiny`` Llama, 2 blocks, byte vocabulary) on the
built-in corpus, 2 CPU ranks, seed 0, twice: with FSDP's exact collectives and with
``--variants qwz+qgz`` (weights all-gathered as int8 blocks of 256, gradients exchanged as int8
blocks by all-to-all and summed in fp32). A run's final loss is the mean of its last 20 steps'
training losses (``loss.csv``); the target is each lossy run's final loss within 1% of its exact
twin's. The table (with the largest gap between the two curves, smoothed over 20 steps) goes to
``OUT/DATE-variants-convergence.md`` and ``.json``; the script exits 1 when a run misses.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time

TARGET = 0.01  # the lossy run's final loss within 1% of the exact run's
LAST = 20  # steps averaged for the final loss
VARIANTS = "qwz+qgz"


def train(impl: str, variants: str, steps: int, out: str) -> tuple[list[float], float]:
    """The training losses of one run, step by step, and its wall time in seconds."""
    command = [sys.executable, "-m", "twinshard.train", "--impls", impl, "--world", "2"]
    command += ["--steps", str(steps), "--out", out, "--checkpoint-every", "0"]
    command += ["--sample-length", "0", "--seed", "0"]
    if variants:
        command += ["--variants", variants]
    started = time.time()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    with open(os.path.join(out, "loss.csv")) as f:
        losses = [float(row["loss"]) for row in csv.DictReader(f)]
    return losses, time.time() - started


def smoothed(losses: list[float]) -> list[float]:
    """Each step's loss averaged with the ``LAST - 1`` steps before it."""
    return [sum(losses[i - LAST + 1 : i + 1]) / LAST for i in range(LAST - 1, len(losses))]


def compare(impl: str, exact: list[float], lossy: list[float]) -> dict:
    final_exact, final_lossy = sum(exact[-LAST:]) / LAST, sum(lossy[-LAST:]) / LAST
    gaps = [abs(a - b) for a, b in zip(smoothed(exact), smoothed(lossy))]
    return {
        "impl": impl,
        "steps": len(exact),
        "first_loss": exact[0],
        "final_exact": final_exact,
        "final_lossy": final_lossy,
        "relative_gap": (final_lossy - final_exact) / final_exact,
        "largest_smoothed_gap": max(gaps),
        "met": abs(final_lossy - final_exact) <= TARGET * final_exact,
    }


def markdown(rows: list[dict], steps: int) -> str:
    lines = [
        f"`twinshard train`'s default model (tiny Llama) on the built-in corpus, 2 gloo ranks, "
        f"{steps} steps, seed 0; final loss = mean of the last {LAST} steps' training losses",
        "",
        f"| implementation | loss at step 1 | final, exact | final, `{VARIANTS}` | gap "
        f"| largest gap of the {LAST}-step averages | within {TARGET:.0%} | wall s (exact, lossy) |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['impl']} | {r['first_loss']:.4f} | {r['final_exact']:.4f} "
            f"| {r['final_lossy']:.4f} | {r['relative_gap']:+.2%} "
            f"| {r['largest_smoothed_gap']:.4f} | {'yes' if r['met'] else '**no**'} "
            f"| {r['wall_s'][0]:.0f}, {r['wall_s'][1]:.0f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--impls", default="torch,reference,optimized")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--out", default="benchmarks/results", help="folder for the results")
    args = parser.parse_args(argv)
    if args.steps < LAST:
        parser.error(f"--steps must be at least {LAST}: the final loss averages that many")
    rows = []
    with tempfile.TemporaryDirectory(prefix="twinshard-convergence-") as scratch:
        for impl in args.impls.split(","):
            exact, exact_s = train(impl, "", args.steps, os.path.join(scratch, f"{impl}-exact"))
            lossy, lossy_s = train(impl, VARIANTS, args.steps, os.path.join(scratch, impl))
            rows.append({**compare(impl, exact, lossy), "wall_s": (exact_s, lossy_s)})
            print(markdown(rows[-1:], args.steps).splitlines()[-1], flush=True)
    text = markdown(rows, args.steps)
    print(text)
    stem = os.path.join(
        args.out, f"{time.strftime('%Y-%m-%d', time.gmtime())}-variants-convergence"
    )
    with open(f"{stem}.md", "w") as f:
        f.write(text + "\n")
    with open(f"{stem}.json", "w") as f:
        json.dump({"command": " ".join(sys.argv), "variants": VARIANTS, "rows": rows}, f, indent=1)
    return 0 if all(r["met"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
