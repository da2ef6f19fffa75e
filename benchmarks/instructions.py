"""Instructions per parameter group and step, counted by valgrind: the hook-overhead setting of
``twinshard bench hooks`` (fake process group, world size 8, 64 blocks of width 32 plus the root).

    python benchmarks/instructions.py                       # plain, reference, optimized, torch
    python benchmarks/instructions.py --impls plain,optimized
    python benchmarks/instructions.py --foreach auto        # the CPU's loop over the parameters
    python benchmarks/instructions.py --inside              # and the part inside the hooks

CPU time on a shared 2-core VM moves by 5-10% from one process to the next, more than a change
of a few percent in the hooks. The number of instructions the CPU executes for the same steps
varies far less, but not by nothing: the optimized path's count per group and step, the same
code twice, was 6,833,895 and 6,892,872 on 2026-11-24 (0.9% apart; 6,901,643 and 6,894,764 for
another pair). A difference under about 60,000 per group and step needs several runs of each.
Each implementation runs twice under ``valgrind --tool=callgrind``, for 2 and for 10 training
steps after the same set-up; the difference divided by 8 steps and 65 groups is the count per group
and step, and the plain model's count subtracted from it is the implementation's overhead.
Instructions are not time (a cache miss costs more than an add), so quote CPU time from
``twinshard bench hooks`` and use this to compare two versions of the code.

``--inside`` counts a third time for each implementation, only the instructions inside its
hooks (forward pre and post, backward pre and post, the end-of-backward callback, each with all
it calls): each hook is called through ``functools.reduce``, a C function nothing else in a step
calls, and valgrind collects only while inside it (``--toggle-collect``). What is left of the
overhead is what the FSDP interface costs around the hooks, whoever implements them: the
optimizer stepping ``DTensor`` parameters, the module calls with hooks, the autograd nodes that
mark a module's backward.

``--run IMPL STEPS FOREACH`` is the part that runs under valgrind: it builds the model and
takes the steps, nothing else. Needs ``valgrind`` (Debian: ``apt-get install valgrind``);
about two and a half minutes per implementation on the 2-core VM.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

STEPS = (2, 10)  # the two runs whose difference is counted


def hooks_config(impl: str, foreach: str = "on"):
    """The ``Job`` that ``twinshard bench hooks --foreach FOREACH`` runs, for ``impl``."""
    from dataclasses import replace

    from twinshard.measure.bench.cli import add_arguments
    from twinshard.measure.bench.compare import job_of

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base, _ = job_of(parser.parse_args(["hooks", "--foreach", foreach]))
    return replace(base, impl=impl)


def take_steps(impl: str, steps: int, foreach: str) -> None:
    import torch

    from twinshard.measure import step, world

    config = hooks_config(impl, foreach)
    torch.set_num_threads(1)
    device = world.join(config.backend, config.world)
    tokens = step.tokens(config, config.llama().vocab_size)
    model, opt = step.build(config, device)
    for _ in range(steps):
        step.train_step(model, opt, tokens)


HOOKS = {  # module -> class -> the hooks a step runs, as each implementation names them
    "optimized": {
        "twinshard.optimized.state": {"FSDPState": ("pre_forward", "post_forward", "pre_backward")},
        "twinshard.reference.state": {"FSDPState": ("post_backward", "final_callback")},
    },
    "reference": {
        "twinshard.reference.state": {
            "FSDPState": (
                "pre_forward",
                "post_forward",
                "pre_backward",
                "post_backward",
                "final_callback",
            ),
        },
    },
    "torch": {
        "torch.distributed.fsdp._fully_shard._fsdp_state": {
            "FSDPState": (
                "_pre_forward",
                "_post_forward",
                "_pre_backward",
                "_root_post_backward_final_callback",
            ),
        },
        "torch.distributed.fsdp._fully_shard._fsdp_param_group": {
            "FSDPParamGroup": ("post_backward",),
        },
    },
}


def through_reduce(impl: str) -> None:
    """Call each hook of ``impl`` (``HOOKS``) through ``functools.reduce``, unless another hook
    is running (valgrind's toggle would switch collection off inside it)."""
    import functools
    import importlib

    depth = [0]

    def wrap(hook):
        def call(*args, **kwargs):
            if depth[0]:
                return hook(*args, **kwargs)
            depth[0] += 1
            try:
                return functools.reduce(lambda _, __: hook(*args, **kwargs), [0], None)
            finally:
                depth[0] -= 1

        return functools.wraps(hook)(call)

    for module, classes in HOOKS[impl].items():
        found = importlib.import_module(module)
        for name, hooks in classes.items():
            cls = getattr(found, name)
            for hook in hooks:
                setattr(cls, hook, wrap(getattr(cls, hook)))


def count(impl: str, steps: int, foreach: str, inside: bool = False) -> int:
    """Instructions of a whole process that takes ``steps`` steps with ``impl``; with
    ``inside``, only those inside its hooks."""
    toggle = ["--toggle-collect=functools_reduce"] if inside else []
    cmd = [
        "valgrind",
        "--tool=callgrind",
        *toggle,
        "--callgrind-out-file=/dev/null",
        os.path.realpath(sys.executable),  # the interpreter itself, not a launcher script
        os.path.abspath(__file__),
        "--run",
        impl,
        str(steps),
        foreach,
        *(["inside"] if inside else []),
    ]
    env = {**os.environ, "PYTHONHASHSEED": "0"}  # the same dict and set orders every run
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stderr
    found = re.search(r"Collected : (\d+)", out)
    if found is None:
        raise RuntimeError(f"valgrind printed no instruction count for {impl}:\n{out[-2000:]}")
    return int(found.group(1))


def per_group_step(impl: str, foreach: str, inside: bool = False) -> int:
    groups = hooks_config(impl).llama().n_layers + 1  # the blocks and the root
    with ThreadPoolExecutor(2) as pool:  # the two runs side by side, one per core
        few, many = pool.map(lambda n: count(impl, n, foreach, inside), STEPS)
    return (many - few) // ((STEPS[1] - STEPS[0]) * groups)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impls", default="plain,reference,optimized,torch")
    parser.add_argument(
        "--foreach",
        choices=("auto", "on", "off"),
        default="on",
        help="the optimizer's foreach, as in twinshard bench hooks (default: on, as there)",
    )
    parser.add_argument("--inside", action="store_true", help="also count inside the hooks")
    parser.add_argument("--run", nargs="+", metavar="IMPL STEPS FOREACH", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        if args.run[3:] == ["inside"]:
            through_reduce(args.run[0])
        take_steps(args.run[0], int(args.run[1]), args.run[2])
        return 0
    if shutil.which("valgrind") is None:
        sys.exit("benchmarks/instructions.py needs valgrind (Debian: apt-get install valgrind)")
    impls = [i for i in args.impls.split(",") if i]
    counts = {impl: per_group_step(impl, args.foreach) for impl in impls}
    floor = counts.get("plain", 0)
    torch_over = counts["torch"] - floor if "torch" in counts else None
    inside = {i: per_group_step(i, args.foreach, True) for i in impls if args.inside and i in HOOKS}
    print(
        "| impl | instructions per group and step | overhead over plain | vs torch | inside hooks |"
    )
    print("|---|---|---|---|---|")
    for impl, n in counts.items():
        over = n - floor
        ratio = f"{over / torch_over:.3f}x" if torch_over and impl != "plain" else "-"
        hooks = f"{inside[impl]:,}" if impl in inside else "-"
        print(f"| {impl} | {n:,} | {over:,} | {ratio} | {hooks} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
