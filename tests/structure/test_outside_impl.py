"""One implementation resolver (``twinshard/commandline/impls.py``) for every command: each
takes a module from outside the project by its import path, as it takes the short names, and
refuses a bad name naming its flag, before any rank starts. The commands that start ranks run in a process of their
own, as a user starts them; the refusals and ``conform`` (whose ranks are the session's shared
worlds) run in this one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from twinshard.cli import main as cli
from twinshard.commandline import impls

# One implementation resolver (twinshard/commandline/impls.py) for every command: a module from
# outside the project, given by its import path, runs wherever the short names do.

OUTSIDE = "my_outside_fsdp"  # re-exports twinshard.reference's interface
TINY = "--model tiny --layers 2 --dim 32 --heads 2 --vocab 64 --seq 8 --per-rank 1".split()
QUICK = "--warmup 1 --steps 2 --repeat 1 --no-progress".split()


@pytest.fixture
def outside(tmp_path) -> dict:
    """The environment of a process that can import ``OUTSIDE`` (a package in ``tmp_path``)."""
    package = tmp_path / "site" / OUTSIDE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "from twinshard.reference import *  # noqa: F403\n"
        "from twinshard.reference import __all__  # noqa: F401\n"
    )
    path = [str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


def _twinshard(env, *args, cwd=None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "twinshard.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=cwd)


def test_bench_takes_a_module_from_outside(outside, tmp_path):
    out = tmp_path / "bench.json"
    flags = ["--backend", "fake", "--world", "2", "--impls", f"{OUTSIDE},reference"]
    done = _twinshard(outside, "bench", *flags, *TINY, *QUICK, "--json", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    assert list(summary) == [OUTSIDE, "reference"]
    assert summary[OUTSIDE]["collectives"] == summary["reference"]["collectives"]
    # the memory predictor records any implementation: this one is the reference renamed
    assert summary[OUTSIDE]["model"] == summary["reference"]["model"]


def test_plan_takes_a_module_from_outside(outside, tmp_path):
    out = tmp_path / "plan.json"
    flags = "--model tiny --world 2 --seq 16 --no-progress --impls".split()
    done = _twinshard(outside, "plan", *flags, OUTSIDE, "--json", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(out.read_text())["plans"]
    assert row["config"]["impl"] == OUTSIDE and "error" not in row, row.get("error")
    assert row["memory"]["fits"]["h100"]


def test_schedule_takes_a_module_from_outside(outside, tmp_path):
    text = tmp_path / "step.txt"
    flags = "--model mlp --layers 1 --world 2 --quiet --impls".split()
    done = _twinshard(outside, "schedule", *flags, OUTSIDE, "--text", str(text), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert text.read_text().startswith(f"{OUTSIDE}, rank 0 of 2: one training step")


def test_the_fake_accelerator_takes_a_module_from_outside(outside, tmp_path):
    out = tmp_path / "fake.json"
    flags = "--world 2 --layers 1 --dim 32 --seq 8 --per-rank 1 --steps 1 --no-cpu".split()
    command = [sys.executable, "-m", "twinshard.measure.fakeaccel", "--impls", OUTSIDE, *flags]
    done = subprocess.run(
        [*command, "--json", str(out)], capture_output=True, text=True, timeout=600, env=outside
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (result,) = json.loads(out.read_text())["results"]
    assert result["config"]["impl"] == OUTSIDE and "error" not in result


def test_conform_takes_a_module_from_outside_and_a_short_name(outside, tmp_path, capsys):
    sys.path.insert(0, outside["PYTHONPATH"].split(os.pathsep)[0])  # in this process and its ranks
    try:
        for impl in (OUTSIDE, "reference"):
            code = cli(["conform", impl, *"--world-sizes 1 --cases one_group --no-oracles".split()])
            said = capsys.readouterr()
            assert code == 0, said.out[-2000:] + said.err[-2000:]
            assert "1 pass" in said.out
    finally:
        sys.path.pop(0)


BAD = "no_such_fsdp_pkg.fsdp"


@pytest.mark.parametrize(
    "args, flag",
    [
        (["bench", "--impls", f"reference,{BAD}", "--json", "x"], "--impls"),
        (["plan", "--model", "tiny", "--impls", BAD, "--json", "x"], "--impls"),
        (["schedule", "--impls", BAD, "--text", "x"], "--impls"),
        (["train", "--impls", BAD, "--steps", "1", "--out", "x"], "--impls"),
    ],
    ids=lambda v: v[0] if isinstance(v, list) else v,
)
def test_a_bad_name_is_refused_naming_the_flag(args, flag, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert _exit_status(lambda: cli(args)) == 2, capsys.readouterr().err[-2000:]
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{flag} {BAD!r}: cannot import {BAD!r}" in said and "importable module" in said
    assert not (tmp_path / "x").exists()


def _exit_status(command) -> int:
    try:
        return command()
    except SystemExit as done:
        return done.code


def test_the_fake_accelerator_and_conform_refuse_a_bad_name(capsys):
    command = [sys.executable, "-m", "twinshard.measure.fakeaccel", "--impls", f"torch,{BAD}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and f"--impls {BAD!r}: cannot import" in done.stderr
    assert _exit_status(lambda: cli(["conform", "json"])) == 2
    assert "json lacks fully_shard" in capsys.readouterr().err


def test_short_names_modules_and_module_objects_resolve_alike():
    import torch.distributed.fsdp

    import twinshard.optimized

    assert impls.load("optimized") is impls.load("twinshard.optimized") is twinshard.optimized
    assert impls.load(torch.distributed.fsdp) is impls.load("torch")
    with pytest.raises(impls.ImplError, match=r"^--impl 'json': json lacks fully_shard"):
        impls.load("json", "--impl")
    assert impls.problem(" plain , optimized", "--impls", also=("plain",)) is None
    assert impls.problem(",", "--impls").startswith("--impls ',': name reference, optimized")
