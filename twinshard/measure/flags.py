"""The flags every measuring command spells alike, and the job they describe.

``twinshard bench``, ``twinshard schedule``, ``twinshard plan`` and ``python -m
twinshard.measure.fakeaccel`` add the flags of a job with ``add(parser, concept, ...)``: one
spelling and one help text per concept (``VOCABULARY``, in ``twinshard/commandline/vocabulary.py``,
which ``twinshard train`` speaks too), each command with its own defaults, which ``--help`` shows.
An old spelling still works and says on stderr, in one line, what replaces it: ``--impl`` (now
``--impls``), ``--preset`` (``--model``), ``--world-size`` and ``--nproc`` (``--world``),
``--batch`` (``--per-rank``). ``job(args)`` is the ``Job`` the flags describe, ``jobs(args)`` one
per implementation, ``problem(jobs)`` the first thing wrong with them: every command makes its jobs
with these (the plan with its own defaults and checks).

``--impls`` takes a comma-separated list in every command: bench compares them, plan prices
each, schedule draws them one above the other, the fake accelerator checks each. ``--device``
is not shared: it says where bench (cpu, cuda) and the fake-accelerator run (fake, cuda) run,
and which device's constants a plan uses (h100, ..., cpu).
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import replace

from twinshard.commandline import impls
from twinshard.commandline.vocabulary import VOCABULARY, Renamed

from .job import OVERRIDES, Job, parse_reshard

JOB = ("impls", "model", "layers", "dim", "heads", "vocab", "world", "hsdp", "per_rank", "seq")
JOB += ("dtype", "reshard", "offload", "variants")
# a shared flag's dest -> the Job field it sets; the model's overrides -> LlamaConfig's names
FIELDS = {"model": "preset", "world": "world", "hsdp": "replicas", "per_rank": "per_rank"}
FIELDS |= {"seq": "seq", "dtype": "dtype", "offload": "offload", "variants": "variants"}
FIELDS |= {"reshard_after_forward": "reshard_after_forward", "prefetch": "prefetch"}
MODEL = {flag.removeprefix("--"): name for name, flag in OVERRIDES.items()}  # layers: n_layers


def add(parser: argparse.ArgumentParser, *concepts: str, **defaults) -> None:
    """Add the flags of ``concepts`` (``VOCABULARY``'s keys) with this command's ``defaults``
    (by concept; a concept without one defaults to None: the command fills it in)."""
    for name in concepts:
        spelling, old, kind, text = VOCABULARY[name]
        default = defaults.get(name)
        if default is not None:
            text += f" (default {default})"
        if kind is None:
            parser.add_argument(spelling, action="store_true", help=text)
        else:
            parser.add_argument(
                spelling, *old, type=kind, default=default, action=Renamed, help=text
            )


def job(args: argparse.Namespace, make=Job, **fields) -> Job:
    """The job ``args`` describes: its shared flags, then ``fields`` for what a flag left
    None or a command does not have, then the defaults of ``make`` (``Job``'s, or a command's
    own: the plan's ``config.job``). The implementation is the first of ``--impls`` (``jobs``
    gives one per name); a ``--reshard-after-forward`` it cannot read stays as given, for
    ``Job.problem`` to name."""
    given = {field: getattr(args, dest, None) for dest, field in FIELDS.items()}
    given["impl"] = next(iter(impls.names(getattr(args, "impls", None) or "")), None)
    given["offload"] = given["offload"] or None  # a switch left off leaves the field's value
    with contextlib.suppress(ValueError):  # None (no such flag) or a value problem() names
        given["reshard_after_forward"] = parse_reshard(str(given["reshard_after_forward"]))
    model = dict(fields.pop("model", {}))
    model |= {k: getattr(args, d) for d, k in MODEL.items() if getattr(args, d, None) is not None}
    if getattr(args, "heads", None) is not None:
        model["n_kv_heads"] = args.heads  # the example models' attention: one key per head
    return make(model=model, **{**fields, **{k: v for k, v in given.items() if v is not None}})


def jobs(args: argparse.Namespace, make=Job, **fields) -> list[Job]:
    """``job(args, make, **fields)`` once per name of ``--impls``."""
    base = job(args, make, **fields)
    names = impls.names(getattr(args, "impls", None) or "") or [base.impl]
    return [replace(base, impl=name) for name in names]


def problem(jobs: list[Job], baselines: bool = False, check=None) -> str | None:
    """The first of ``jobs``' problems, or None: ``check``'s (a command's own validator, such
    as the plan's ``config.problem``), or ``Job.problem``'s (``baselines``: its own)."""
    check = check or (lambda job: job.problem(baselines))
    return next(filter(None, map(check, jobs)), None)
