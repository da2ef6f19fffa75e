"""Gradient clipping over sharded gradients: torch's ``clip_grad_norm_`` against
``twinshard.clip_grad.clip_grad_norm_``, and against the same clipping over plain tensors.

    python benchmarks/clip_grad_norm.py
    python benchmarks/clip_grad_norm.py --out benchmarks/results/DATE-clip-grad-norm.md

The setting of ``benchmarks/optimizer_step.py`` (``twinshard bench hooks``' model: a fake process
group of ``--world`` ranks, this process rank 0, 64 blocks of width 32, one training step taken
so every parameter has its gradient). For torch's ``fully_shard`` and the optimized path it
times, ``--repeat`` times after ``--warmup``, torch's ``clip_grad_norm_`` over the ``DTensor``
gradients and twinshard's, each from the same gradients, for the 2-norm with a ``max_norm``
that clips; and torch's over plain tensors holding the local shards (``plain``: the arithmetic
alone, no all-reduce). It prints the median milliseconds and the ratios, checks that the two
clip to the same bits, and exits 1 where they do not, or where ``--target-torch`` is given and
twinshard's is above that fraction of torch's over the same gradients.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # optimizer_step.py beside it

MAX_NORM = 1e-3  # below every total norm of the setting: every call scales the gradients


def timed(clip, params, start, warmup: int, repeat: int):
    """Median seconds of ``clip(params, MAX_NORM)``, each call from the gradients ``start``,
    and the gradients and total of the last call."""
    seconds = []
    for i in range(warmup + repeat):
        for p, g in zip(params, start):
            local(p.grad).copy_(g)
        begin = time.perf_counter()
        total = clip(params, MAX_NORM)
        if i >= warmup:
            seconds.append(time.perf_counter() - begin)
    total = total.full_tensor() if hasattr(total, "full_tensor") else total
    return statistics.median(seconds), [local(p.grad).clone() for p in params], total


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impls", default="torch,optimized")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--out", help="also write the table to this markdown file")
    parser.add_argument("--target-torch", type=float, help="twinshard's most over torch's")
    args = parser.parse_args(argv)
    import torch
    from optimizer_step import plain_twin, report, sharded

    from twinshard.clip_grad import clip_grad_norm_

    torch.set_num_threads(1)
    lines, missed = [], []
    for impl in args.impls.split(","):
        params = list(sharded(impl, args.world).parameters())
        start = [local(p.grad).clone() for p in params]
        twins = plain_twin([(local(p).detach(), g) for p, g in zip(params, start)])
        plain, _, _ = timed(torch.nn.utils.clip_grad_norm_, twins, start, args.warmup, args.repeat)
        theirs = timed(torch.nn.utils.clip_grad_norm_, params, start, args.warmup, args.repeat)
        mine = timed(clip_grad_norm_, params, start, args.warmup, args.repeat)
        same = all(map(torch.equal, theirs[1], mine[1])) and torch.equal(theirs[2], mine[2])
        ratio = mine[0] / theirs[0]
        if not lines:
            lines += [
                f"clip_grad_norm_ (2-norm, max_norm {MAX_NORM}), fake world of {args.world}, "
                f"{len(params)} parameters, median of {args.repeat} calls after "
                f"{args.warmup}, torch {torch.__version__}",
                "",
                "| parameters of | plain | torch's clip | twinshard's clip | twinshard's / "
                "torch's | twinshard's / plain | bitwise |",
                "|---|---|---|---|---|---|---|",
            ]
        lines.append(
            f"| {impl} | {plain * 1e3:.2f} ms | {theirs[0] * 1e3:.2f} ms | "
            f"{mine[0] * 1e3:.2f} ms | {ratio:.2f}x | {mine[0] / plain:.2f}x | "
            f"{'yes' if same else 'NO'} |"
        )
        if not same:
            missed.append(f"{impl}: twinshard's clip is not torch's bit for bit")
        if args.target_torch and ratio > args.target_torch:
            missed.append(f"{impl}: twinshard's clip {ratio:.2f}x torch's")
    return report(lines, missed, args.out)


if __name__ == "__main__":
    sys.exit(main())
