"""Misuse of ``twinshard conform``: every bad argument is refused before a rank starts, with one
line and exit status 2, and ``--device cuda`` without the GPUs it needs is an error, not a run
that passes having checked nothing (``--skip-missing-gpus`` makes it a report of skips)."""

from __future__ import annotations

import pytest
import torch

from twinshard.cli import main as cli


def conform_refused(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as done:
        cli(["conform", *map(str, argv)])
    assert done.value.code == 2, argv
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert err.startswith("twinshard conform: "), err
    assert "twinshard conform twinshard" not in captured.out  # the suite never started
    return err


def test_a_module_with_a_syntax_error_is_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "broken_fsdp.py").write_text("def fully_shard(module:\n    return module\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    err = conform_refused(capsys, "broken_fsdp")
    assert "cannot import 'broken_fsdp': SyntaxError: " in err
    assert f"({tmp_path / 'broken_fsdp.py'}, line 1)" in err


def test_a_module_that_fails_while_importing_is_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "raising_fsdp.py").write_text("raise RuntimeError('no GPU driver')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    err = conform_refused(capsys, "raising_fsdp")
    assert "cannot import 'raising_fsdp': RuntimeError: no GPU driver" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--world-sizes", "0"], "bad mesh '0'"),
        (["--world-sizes", "two"], "bad mesh 'two'"),
        (["--cases", "no_such_case_*"], "no case matches ['no_such_case_*']"),
        (["--timeout", "0"], "--timeout must be positive, got 0.0"),
        (["--timeout", "nan"], "--timeout must be positive, got nan"),
        (["--xfail", "/no/such/file.txt"], "No such file or directory"),
        (["--report", "/no/such/folder/out.md"], "cannot write --report /no/such/folder/out.md"),
        (["--report", "/proc/version"], "cannot write --report /proc/version"),
        (["--variant", "nosuch_module:X"], "--variant 'nosuch_module:X': No module named"),
        (["--variant", "os:path"], "--variant 'os:path' has no attach, gathered"),
        (["--variant", "qwz:bits=3"], "--variants: 'qwz:bits=3'"),
        (["--variant", "justaname"], "use MODULE:NAME or built-ins"),
    ],
)
def test_bad_arguments_are_one_line(capsys, argv, message):
    assert message in conform_refused(capsys, "twinshard.reference", *argv)


def test_a_report_that_is_a_directory_is_refused(tmp_path, capsys):
    err = conform_refused(capsys, "twinshard.reference", "--report", tmp_path)
    assert f"--report {tmp_path} is a directory" in err


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="needs a machine without GPUs")
def test_cuda_without_gpus_is_an_error(capsys):
    err = conform_refused(capsys, "twinshard.reference", "--device", "cuda", "--world-sizes", "1,2")
    assert "--device cuda but 0 GPU(s) here, and mesh(es) 2, 1 need more" in err
    assert "--skip-missing-gpus" in err


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="needs a machine without GPUs")
def test_cuda_without_gpus_may_be_skipped_explicitly(capsys):
    code = cli(
        ["conform", "twinshard.reference", "--device", "cuda", "--world-sizes", "1"]
        + ["--cases", "one_group", "--skip-missing-gpus"]
    )
    out = capsys.readouterr().out
    assert code == 0 and "needs 1 GPUs, 0 present" in out and "twinshard.reference: 1 skip" in out
