"""ruff, configured in pyproject.toml, stays clean: lint and format, notebooks included."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_is_clean(command):
    out = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_no_file_is_over_400_lines():
    files = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    long = {f: n for f in files if (n := len((ROOT / f).read_text().splitlines())) > 400}
    assert not long, f"split these by concept: {long}"
