"""One job vocabulary for the measuring commands (issue 32, item 1).

``twinshard bench``, ``schedule``, ``plan`` and ``python -m twinshard.measure.fakeaccel`` spell each
concept of a job alike, with one help text; an old spelling still works and says what replaces
it; the same misuse gets the same one-line message from every command; the same flags make the
same job. How the measuring package is layered is checked in ``test_layers.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from twinshard.cli import main
from twinshard.commandline.vocabulary import VOCABULARY
from twinshard.measure.bench import cli as bench
from twinshard.measure.bench import compare
from twinshard.measure.fakeaccel import cli as fakeaccel
from twinshard.measure.job import Job
from twinshard.measure.plan import cli as plan
from twinshard.measure.schedule import cli as schedule

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = {"bench": bench, "schedule": schedule, "plan": plan, "fakeaccel": fakeaccel}


def _parser(command) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    command.add_arguments(parser)
    return parser


def _options(parser: argparse.ArgumentParser) -> dict:
    return {o: a for a in parser._actions for o in a.option_strings}


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_spells_the_job_alike_with_one_help_text(name):
    options = _options(_parser(COMMANDS[name]))
    for spelling, old, _, text in VOCABULARY.values():
        if spelling not in options:
            continue
        action = options[spelling]
        assert action.help.split(" (default")[0] == text, spelling
        assert set(old) <= set(action.option_strings), spelling
    shared = ("--impls", "--model", "--layers", "--world", "--reshard-after-forward")
    assert set(shared) <= set(options), sorted(set(shared) - set(options))


ALIASES = [
    (command, old, spelling)
    for command in COMMANDS
    for spelling, olds, kind, _ in VOCABULARY.values()
    for old in olds
    if spelling in _options(_parser(COMMANDS[command]))
]


@pytest.mark.parametrize("command,old,spelling", ALIASES, ids=lambda v: str(v))
def test_an_old_spelling_works_and_names_its_replacement(command, old, spelling, capsys):
    value = {"--impl": "torch", "--preset": "tiny"}.get(old, "3")
    new = _parser(COMMANDS[command]).parse_args([spelling, value])
    assert not capsys.readouterr().err
    renamed = _parser(COMMANDS[command]).parse_args([old, value])
    assert vars(renamed) == vars(new)
    assert capsys.readouterr().err == f"note: {old} is now {spelling}\n"


@pytest.mark.parametrize(
    "flags_given,said",
    [
        ("--world 8 --hsdp 3", "--hsdp 3 does not divide --world 8: use a divisor"),
        ("--per-rank 0", "--per-rank must be a positive integer, got 0"),
        ("--layers 0", "--layers must be a positive integer, got 0"),
        ("--world 4 --reshard-after-forward 3", "--reshard-after-forward 3 must divide"),
        ("--dtype fp16", "--dtype 'fp16' unknown; use fp32, bf16"),
        ("--model huge", "--model 'huge': not a preset"),
    ],
)
def test_the_same_misuse_gets_the_same_message_from_every_command(flags_given, said, capsys):
    for command in ("bench", "plan"):
        assert main([command, *flags_given.split()]) == 2
        assert capsys.readouterr().err.startswith(f"twinshard {command}: error: {said}")
    args = _parser(fakeaccel).parse_args(flags_given.split())
    with pytest.raises(SystemExit, match=said.split("(")[0]):
        fakeaccel.configs_from(args)


def test_the_same_flags_make_the_same_job():
    words = "--impls torch --model tiny --layers 3 --world 4 --hsdp 2 --per-rank 3 --seq 32"
    words += " --dtype bf16 --offload --reshard-after-forward 2"
    jobs = {
        "bench": compare.job_of(_parser(bench).parse_args(words.split()))[0],
        "plan": plan.configs_from(_parser(plan).parse_args(words.split()))[0][0][0],
        "fakeaccel": fakeaccel.configs_from(_parser(fakeaccel).parse_args(words.split()))[0],
    }
    shared = "impl preset model world replicas per_rank seq dtype offload reshard_after_forward"
    seen = {name: {k: getattr(job, k) for k in shared.split()} for name, job in jobs.items()}
    assert seen["bench"] == seen["plan"] == seen["fakeaccel"], seen
    assert seen["bench"]["model"] == {"n_layers": 3}
    assert seen["bench"]["reshard_after_forward"] == 2 and seen["bench"]["replicas"] == 2


def test_the_validator_reads_the_job_not_the_command_line():
    assert Job().problem() is None
    assert Job(impl="plain").problem() is not None  # a baseline only where the bench runs it
    assert Job(impl="plain").problem(baselines=True) is None
    assert "--heads" in Job(model={"n_heads": 0}).problem()
    assert "does not divide" in Job(world=6, replicas=4).problem()
    wrong = Job(reshard_after_forward="sometimes").problem()
    assert wrong.startswith("--reshard-after-forward takes true, false or an int")


def test_bench_on_the_fake_accelerator_runs_the_sharded_ones_and_skips_the_baselines():
    def problem(impls: str):
        args = _parser(bench).parse_args(["--backend", "fakeaccel", "--impls", impls])
        return compare.problem(args, *compare.job_of(args))

    assert problem("plain,optimized") is None
    assert problem("plain,ddp").startswith("--backend fakeaccel runs FSDP implementations only")
    assert problem("plain,nowhere_fsdp").startswith("--impls 'nowhere_fsdp'")
