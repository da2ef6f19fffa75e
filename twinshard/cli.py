"""The ``twinshard`` command: one entry point, a subcommand per job.

    twinshard train ...     train the example Llama-style model with FSDP   (twinshard.train.cli)
    twinshard export ...    write a checkpoint as one full state dict file  (twinshard.train.export)
    twinshard conform ...   check an implementation against the truth       (twinshard.conformance.cli)
    twinshard schedule ...  draw one training step, hook by hook              (twinshard.measure.schedule.cli)
    twinshard bench ...     the implementations side by side                  (twinshard.measure.bench.cli)
    twinshard plan ...      a job's memory and speed at any scale, from a CPU (twinshard.measure.plan.cli)

Each subcommand lives in its own module, imported only when it runs, so ``twinshard --help``
stays fast and one job's dependencies never load for another.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help); the module provides add_arguments(parser) and run(args)
SUBCOMMANDS = {
    "train": ("twinshard.train.cli", "train the example Llama-style model with FSDP"),
    "export": ("twinshard.train.export", "write a checkpoint as a single full state dict file"),
    "conform": ("twinshard.conformance.cli", "check an FSDP implementation against the truth"),
    "schedule": ("twinshard.measure.schedule.cli", "draw one training step, hook by hook"),
    "bench": (
        "twinshard.measure.bench.cli",
        "plain, DDP, reference, optimized and torch side by side",
    ),
    "plan": (
        "twinshard.measure.plan.cli",
        "memory, communication and step time of a job, from one CPU",
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="twinshard", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        parser.parse_args(argv[:1] or ["--help"])  # prints help, or the unknown-command error
        return 2
    module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
    command = argparse.ArgumentParser(
        prog=f"twinshard {argv[0]}", description=module.__doc__.split("\n")[0]
    )
    module.add_arguments(command)
    result = module.run(command.parse_args(argv[1:]))
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
