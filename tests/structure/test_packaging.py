"""The namespaced layout: top-level folders install as twinshard.reference etc., from anywhere."""

import pathlib
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_imports_from_another_directory(tmp_path):
    code = (
        "import twinshard.reference, twinshard.optimized, twinshard.conformance, "
        "twinshard.api, twinshard.ranks.launch, twinshard.models; "
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
    assert "twinshard/api/__init__.py" in names
    tops = {n.split("/")[0] for n in names}
    assert not tops & {"reference", "optimized", "conformance", "tests"}, tops


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    line = next(line for line in ci.splitlines() if line.startswith("COMMAND="))
    command = line.removeprefix("COMMAND=").strip("'")
    assert "pytest" in command and command in readme, (
        "README.md must give the exact test command that .ci/run runs"
    )


def test_ci_installs_pinned_versions_of_every_extra():
    """.ci/run installs with the constraints file, which pins every package the extras name
    (and torch, at the version every pip command names) to one version."""
    import re

    import tomllib
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    ci = (ROOT / ".ci" / "run").read_text()
    installs = [line for line in ci.splitlines() if "pip install" in line]
    assert installs and all("torch==2.13.0" in line for line in installs), installs
    assert "-c .ci/constraints.txt" in ci
    pins = {}
    for line in (ROOT / ".ci" / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert re.fullmatch(r"[0-9][0-9A-Za-z.+-]*", version), f"not an exact pin: {line!r}"
            pins[canonicalize_name(name)] = version
    assert pins.pop("torch") == "2.13.0"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = extras["optional-dependencies"]
    named = {canonicalize_name(Requirement(r).name) for deps in extras.values() for r in deps}
    missing = sorted(named - {"twinshard"} - set(pins))
    assert not missing, f"extras' packages without a pin in .ci/constraints.txt: {missing}"
