"""The namespaced layout: top-level folders install as twinshard.reference etc., from anywhere."""

import pathlib
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_imports_from_another_directory(tmp_path):
    code = (
        "import twinshard.reference, twinshard.optimized, twinshard.conformance, "
        "twinshard.api, twinshard.launch, twinshard.models; "
        "print(twinshard.reference.fully_shard.__module__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "twinshard.reference.fully_shard"


def test_wheel_holds_only_the_namespaced_packages(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
    )
    wheel = next(tmp_path.glob("twinshard-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "twinshard/reference/fully_shard.py" in names
    assert "twinshard/conformance/cases/core.py" in names
    assert "twinshard/train/cli.py" in names
    assert any(n.endswith("licenses/LICENSE") for n in names)
    assert "twinshard/api.py" in names
    tops = {n.split("/")[0] for n in names}
    assert not tops & {"reference", "optimized", "conformance", "tests"}, tops


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = next(line.strip() for line in ci.splitlines() if "pytest" in line)
    assert command in readme, "README.md must give the exact test command that .ci/run runs"
