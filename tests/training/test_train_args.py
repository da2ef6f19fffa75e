"""Misuse of ``twinshard train`` and ``twinshard export``: each bad argument is refused before
anything runs, with one line and no traceback; data without a single newline trains. Train's
old flag spellings still parse, with a note, and its shared flags are spelled as the measuring
commands' vocabulary spells them.

(The refusals that ``test_train.py`` already covers, batch splits, learning rates, missing data
and checkpoints, are not repeated here.)
"""

from __future__ import annotations

import argparse
import subprocess

import pytest
from train_support import run_train, snapshot

from twinshard.cli import main as cli
from twinshard.commandline.vocabulary import VOCABULARY
from twinshard.train import flags


def refused(capsys, *argv) -> str:
    """Run ``twinshard train`` (small model) and return its one-line refusal."""
    assert run_train(*argv) == 2, argv
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert err.startswith("twinshard train: error: "), err
    return err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dim", "0"], "--dim must be positive, got 0"),
        (["--dim", "-8"], "--dim must be positive, got -8"),
        (["--layers", "-1"], "--layers must be positive, got -1"),
        (["--layers", "0"], "--layers must be positive, got 0"),
        (["--heads", "0"], "--heads must be positive, got 0"),
        (["--world", "0"], "--world must be positive, got 0"),
        (["--world", "-2"], "--world must be positive, got -2"),
        (["--seq", "-1"], "--seq must be positive, got -1"),
        (["--batch-size", "0"], "--batch-size must be positive, got 0"),
        (["--grad-accum", "0"], "--grad-accum must be positive, got 0"),
        (["--keep", "0"], "--keep must be positive, got 0"),
        (["--log-every", "0"], "--log-every must be positive, got 0"),
        (["--checkpoint-every", "-1"], "--checkpoint-every must be >= 0, got -1"),
        (["--eval-batches", "-1"], "--eval-batches must be >= 0, got -1"),
        (["--sample-length", "-5"], "--sample-length must be >= 0, got -5"),
        (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
        (["--lr", "nan"], "--lr must be positive, got nan"),
        (["--clip-norm", "inf"], "--clip-norm must be >= 0, got inf"),
        (["--hang-timeout", "-1"], "--hang-timeout must be >= 0, got -1.0"),
        (["--stop-at", "0"], "--stop-at 0 must be between 1 and --steps"),
        (["--seq", "2000000"], "too few for windows of 2000001"),
    ],
)
def test_every_numeric_flag_is_checked(tmp_path, capsys, argv, message):
    out = tmp_path / "run"
    assert message in refused(capsys, "--out", out, *argv)
    assert not out.exists()


def test_an_unwritable_out_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    err = refused(capsys, "--out", blocker / "run")
    assert f"cannot write the run directory {blocker / 'run'}: Not a directory" in err
    assert "choose another --out" in err


def test_a_read_only_out_is_one_line(tmp_path, capsys):
    folder = tmp_path / "ro"
    folder.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True
    )
    if done.returncode:
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    try:
        err = refused(capsys, "--out", folder / "run")
        assert f"cannot write the run directory {folder / 'run'}: Read-only file system" in err
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_data_without_a_newline_trains(tmp_path, capsys):
    """8 MB of bytes and not one newline: read as a memory map, hashed in bounded pieces."""
    data = tmp_path / "one-line.txt"
    data.write_bytes(bytes(range(32, 127)) * (8 << 20 // 95))
    assert b"\n" not in data.read_bytes()
    out = tmp_path / "run"
    assert run_train("--out", out, "--data", data, "--steps", 2) == 0
    assert "step 2/2" in (out / "train.log").read_text()


# ------------------------------------------------------------------- the shared vocabulary
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="twinshard train")
    flags.add_arguments(p)
    return p


@pytest.mark.parametrize(
    "old, new, dest, value",
    [
        (["--impl", "torch"], ["--impls", "torch"], "impl", "torch"),
        (["--nproc", "3"], ["--world", "3"], "nproc", 3),
        (["--preset", "small"], ["--model", "small"], "preset", "small"),
        (["--n-layers", "3"], ["--layers", "3"], "n_layers", 3),
        (["--n-heads", "2"], ["--heads", "2"], "n_heads", 2),
        (["--seq-len", "64"], ["--seq", "64"], "seq_len", 64),
        (["--cpu-offload"], ["--offload"], "cpu_offload", True),
        (["--no-cpu-offload"], ["--no-offload"], "cpu_offload", False),
    ],
)
def test_an_old_spelling_parses_alike_and_names_its_replacement(capsys, old, new, dest, value):
    """The dest is the one a checkpoint remembers, so a run started with the old spelling
    resumes under the new one."""
    by_old = parser().parse_args(old)
    assert capsys.readouterr().err == f"note: {old[0]} is now {new[0]}\n"
    by_new = parser().parse_args(new)
    assert capsys.readouterr().err == ""
    assert by_old == by_new and getattr(by_new, dest) == value


def test_train_spells_each_shared_concept_as_the_measuring_commands():
    """Each concept of ``SHARED`` under ``VOCABULARY``'s spelling, and no spelling of the
    vocabulary (old ones included) used by train for something ``SHARED`` does not list."""
    actions = parser()._option_string_actions
    for concept, (dest, old) in flags.SHARED.items():
        action = actions[VOCABULARY[concept][0]]
        assert action.dest == dest and action.option_strings[0] == VOCABULARY[concept][0]
        assert all(actions[spelling] is action for spelling in old), concept
    for concept, (spelling, old, _, _) in VOCABULARY.items():
        for used in {spelling, *old} & actions.keys():
            assert concept in flags.SHARED, f"{used} is {concept} of the vocabulary"
            assert actions[used].dest == flags.SHARED[concept][0], used
    assert set(flags.DEFAULTS) <= {a.dest for a in actions.values()}  # what resume reads


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--impls", "reference,torch"], "argument --impls/--impl: train takes one"),
        (["--impl", "optimized, torch"], "argument --impls/--impl: train takes one"),
        (["--model", "llama3-8b"], "argument --model/--preset: train builds one of its presets"),
        (["--model", "config.json"], "argument --model/--preset: train builds one of its"),
    ],
)
def test_what_only_the_measuring_commands_take_is_refused_naming_the_flag(
    tmp_path, capsys, argv, message
):
    with pytest.raises(SystemExit) as done:
        run_train("--out", tmp_path / "run", *argv)
    assert done.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# -------------------------------------------------------------------------------- export
def export_refused(capsys, *argv) -> str:
    assert cli(["export", *map(str, argv)]) == 2, argv
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


def test_export_refuses_bad_outputs_before_reading_the_checkpoint(short_run, tmp_path, capsys):
    before = snapshot(short_run)
    folder = tmp_path / "a-directory"
    folder.mkdir()
    err = export_refused(capsys, short_run, folder, "--force")
    assert f"{folder} is a directory; name the file to write" in err
    err = export_refused(capsys, short_run, tmp_path / "missing" / "m.safetensors")
    assert "the directory" in err and "does not exist" in err
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    err = export_refused(capsys, short_run, blocker / "m.safetensors")
    assert f"the directory {blocker} does not exist" in err
    err = export_refused(capsys, tmp_path / "nowhere", tmp_path / "m.safetensors")
    assert "does not exist; pass a run directory" in err
    err = export_refused(capsys, tmp_path, tmp_path / "m.safetensors")
    assert f"no complete checkpoint in {tmp_path}" in err
    assert snapshot(short_run) == before and list(folder.iterdir()) == []
