"""The optimizer's step over sharded parameters, against the same step over plain tensors.

    python benchmarks/optimizer_step.py                  # every optimizer, torch and optimized
    python benchmarks/optimizer_step.py --optimizers adamw-foreach --repeat 200
    python benchmarks/optimizer_step.py --out benchmarks/results/DATE-optimizer-step.md

FSDP2 hands the optimizer ``DTensor`` parameters. Each of the optimizer's operations then goes
through ``DTensor``'s dispatch, in Python, before it reaches the kernel that the same step over
plain tensors calls directly. On a small model or one with many small parameters that
dispatch, not the arithmetic, is the step. This measures it where ``twinshard bench hooks``
measures the hooks: a fake process group of ``--world`` ranks (8), this process rank 0, the
Llama of 64 blocks of width 32 (65 groups: 9 parameters a block, the root's 3), one training
step taken so that every parameter has its gradient, then ``optimizer.step()`` timed alone,
``--repeat`` times after ``--warmup``, for each implementation and for ``plain``: the same
optimizer over plain tensors holding the local shards of torch's parameters, the cost of the
arithmetic alone.

For each optimizer (torch's own: AdamW and SGD with momentum, each with ``foreach`` on and off
and ``fused`` where torch offers it on the CPU) it prints the median seconds per step and the
ratios to ``plain`` and to torch's. It also checks that the steps agree: after the same steps
every implementation's local shards are bitwise equal to ``plain``'s, and the script exits 1 if
not, or if ``--target-plain``/``--target-torch`` is given and the judged step (``--judge``) of
an optimizer in ``--target-optimizers`` (AdamW with ``foreach``, issue 53's) misses it.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # instructions.py beside it

OPTIMIZERS = {  # name -> (torch.optim class name, keyword arguments)
    "adamw-foreach": ("AdamW", dict(lr=1e-3, weight_decay=0.1, foreach=True)),
    "adamw-loop": ("AdamW", dict(lr=1e-3, weight_decay=0.1, foreach=False)),
    "adamw-fused": ("AdamW", dict(lr=1e-3, weight_decay=0.1, fused=True)),
    "sgd-foreach": ("SGD", dict(lr=1e-3, momentum=0.9, foreach=True)),
    "sgd-loop": ("SGD", dict(lr=1e-3, momentum=0.9, foreach=False)),
    "sgd-fused": ("SGD", dict(lr=1e-3, momentum=0.9, fused=True)),
}
IMPLS = ("torch", "optimized", "optimized+local_step")
LOCAL = "+local_step"  # the implementation's parameters, the optimizer wrapped by local_step


def sharded(impl: str, world: int):
    """``impl``'s model of ``twinshard bench hooks`` on a fake world of ``world`` ranks, after
    one training step (every parameter has its gradient)."""
    import torch
    from instructions import hooks_config  # beside this script

    from twinshard.measure import step
    from twinshard.measure import world as worlds

    config = dataclasses.replace(hooks_config(impl), world=world)
    device = worlds.join(config.backend, config.world)
    model, _ = step.build(config, device)
    torch.manual_seed(1)
    step.loss(model, step.tokens(config, config.llama().vocab_size)).backward()
    return model


def local(t):
    """A ``DTensor``'s local tensor, or the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def plain_twin(start):
    """Plain leaf tensors holding copies of ``start``'s (local shard, gradient) pairs."""
    twins = []
    for value, grad in start:
        twin = value.clone().requires_grad_(True)
        twin.grad = grad.clone()
        twins.append(twin)
    return twins


def timed(params, optimizer: str, warmup: int, repeat: int, wrapped: bool = False):
    """Median seconds of ``optimizer``'s step over ``params`` (``wrapped``: by
    ``twinshard.local_step``), and their local tensors after ``warmup + repeat``
    steps."""
    import torch

    from twinshard.local_step import local_step

    name, kwargs = OPTIMIZERS[optimizer]
    opt = getattr(torch.optim, name)(params, **kwargs)
    if wrapped:
        local_step(opt)
    for _ in range(warmup):
        opt.step()
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        opt.step()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), [local(p).detach().clone() for p in params]


def fused_on_cpu(optimizer: str) -> bool:
    import torch

    name, kwargs = OPTIMIZERS[optimizer]
    if not kwargs.get("fused"):
        return True
    try:
        getattr(torch.optim, name)([torch.zeros(1, requires_grad=True)], **kwargs)
    except RuntimeError:
        return False
    return True


def cell(refused: dict, impl: str, value: float | None, unit: str) -> str:
    """A table cell: ``value`` with its unit, or why ``impl`` refused the optimizer."""
    return f"refused ({refused[impl]})" if impl in refused else f"{value:.2f}{unit}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--out", help="also write the table to this markdown file")
    parser.add_argument("--judge", default=IMPLS[-1], help="the implementation the targets judge")
    parser.add_argument(
        "--target-optimizers", default="adamw-foreach", help="the optimizers the targets judge"
    )
    parser.add_argument("--target-plain", type=float, help="the judged step's most over plain")
    parser.add_argument("--target-torch", type=float, help="the judged step's most over torch's")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    impls = args.impls.split(",")
    built = {i.removesuffix(LOCAL) for i in impls}
    models = {impl: sharded(impl, args.world) for impl in sorted(built)}
    first = list(models[sorted(built)[0]].parameters())
    start = [(local(p).detach().clone(), local(p.grad).clone()) for p in first]
    lines = [
        f"optimizer step, fake world of {args.world}, {len(first)} parameters, median of "
        f"{args.repeat} steps after {args.warmup}, torch {torch.__version__}",
        "",
        "| optimizer | " + " | ".join(["plain", *impls]) + " | "
        + " | ".join(f"{i} / plain" for i in impls) + f" | {args.judge} / torch | bitwise |",
        "|---" * (2 * len(impls) + 4) + "|",
    ]  # fmt: skip
    missed = []
    for optimizer in args.optimizers.split(","):
        if not fused_on_cpu(optimizer):
            lines.append(f"| {optimizer} | not offered on the CPU by this torch |")
            continue
        base, after = timed(plain_twin(start), optimizer, args.warmup, args.repeat)
        medians, same, refused = {}, True, {}
        for impl in impls:
            params = list(models[impl.removesuffix(LOCAL)].parameters())
            for p, (value, grad) in zip(params, start):  # each starts where plain did
                local(p).detach().copy_(value)
                local(p.grad).copy_(grad)
            try:
                medians[impl], got = timed(
                    params, optimizer, args.warmup, args.repeat, impl.endswith(LOCAL)
                )
            except (NotImplementedError, RuntimeError) as error:  # torch's fused SGD on DTensor
                refused[impl] = str(error).splitlines()[0].split(" does not")[0][:60]
                continue
            same &= all(torch.equal(a, b) for a, b in zip(after, got))

        ratio = {i: medians[i] / base for i in medians}
        judged = args.judge
        vs_torch = medians[judged] / medians["torch"] if {"torch", judged} <= set(medians) else None
        lines.append(
            f"| {optimizer} | {base * 1e3:.2f} ms | "
            + " | ".join(cell(refused, i, medians.get(i, 0) * 1e3, " ms") for i in impls) + " | "
            + " | ".join(cell(refused, i, ratio.get(i), "x") for i in impls) + " | "
            + (f"{vs_torch:.2f}x" if vs_torch else "-") + f" | {'yes' if same else 'NO'} |"
        )  # fmt: skip
        if not same:
            missed.append(f"{optimizer}: not bitwise equal to the step over plain tensors")
        if judged in refused:
            missed.append(f"{optimizer}: {judged} refused")
        targeted = optimizer in args.target_optimizers.split(",")
        if targeted and args.target_plain and ratio.get(judged, 0) > args.target_plain:
            missed.append(f"{optimizer}: {judged} {ratio[judged]:.2f}x plain")
        if targeted and args.target_torch and vs_torch and vs_torch > args.target_torch:
            missed.append(f"{optimizer}: {judged} {vs_torch:.2f}x torch")
    return report(lines, missed, args.out)


def report(lines: list[str], missed: list[str], out: str | None) -> int:
    """Print the table ``lines`` and a line per missed target, write them to ``out`` too
    (markdown), and return the exit status: 1 where a target was missed."""
    text = "\n".join(lines + [""] + [f"MISSED {m}" for m in missed])
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
