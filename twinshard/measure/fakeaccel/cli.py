"""The fake-accelerator run from the command line: a W-rank accelerator job, checked on the CPU.

    python -m twinshard.measure.fakeaccel                  # W = 8, tiny Llama, bf16, all three
    python -m twinshard.measure.fakeaccel --world 64 --hsdp 8 --offload --reshard-after-forward 4
    python -m twinshard.measure.fakeaccel --impls optimized --world 1024 --json out.json
    twinshard bench --backend fakeaccel --world 64         # the same, from twinshard bench
    python -m twinshard.measure.fakeaccel --device cuda    # the same checks on a real GPU

Each implementation (``--impls``: reference, optimized, torch or a module path) trains
``--steps`` steps on the fake accelerator in one spawned process, which plays rank 0 of
``--world`` ranks; the report gives per configuration the host syncs, the explicit syncs, the
collectives with host tensors, the collectives (and whether they equal the CPU run's), the peak
bytes on the device, what FSDP holds and the caching allocator's reserved peak (see
``report.py``). The exit status is 1 if any configuration failed, synced the host, sent a host
tensor to a collective or issued other collectives than the CPU run.
"""

from __future__ import annotations

import argparse

from twinshard.measure import flags
from twinshard.measure.job import SHARDED, Job

from .report import check_and_report
from .runner import STEPS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    job = dict(impls=",".join(SHARDED), world=8, hsdp=1, model="tiny", seq=16, per_rank=2)
    flags.add(parser, *flags.JOB, "json", "markdown", **job, dtype="bf16", reshard="true")
    add = parser.add_argument
    add("--steps", type=int, default=STEPS, help="training steps per run")
    add("--no-cpu", action="store_true", help="skip the CPU run's collectives")
    where = "fake (the fake accelerator, default) or a real device type such as cuda"
    add("--device", default="fake", help=where)


def configs_from(args) -> list[Job]:
    """One job per implementation; ``SystemExit`` with the first problem of any."""
    jobs = flags.jobs(args, backend="fakeaccel")
    wrong = flags.problem(jobs)
    if wrong:
        raise SystemExit(wrong)
    return jobs


def run(args) -> int:
    return check_and_report(configs_from(args), args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m twinshard.measure.fakeaccel", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
