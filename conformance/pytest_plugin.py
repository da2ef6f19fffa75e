"""pytest plugin: run the conformance suite as tests, one per (mesh, case).

Installed with twinshard (entry point ``pytest11``); it only adds options until asked:

    pytest --pyargs twinshard.conformance.check --fsdp-impl my_pkg.my_fsdp
    TWINSHARD_IMPL=my_pkg.my_fsdp pytest --pyargs twinshard.conformance.check

Options: ``--fsdp-impl`` (or ``TWINSHARD_IMPL``), ``--fsdp-world-sizes`` (default
1,2,3,2x2), ``--fsdp-cases`` (patterns), ``--fsdp-device`` (cpu or cuda), ``--fsdp-xfail``
(expected-failures file; torch's shipped file is used by default for torch),
``--fsdp-stand-in-streams`` (the accelerator schedule on the CPU, checked). Each mesh is one
process group in which all its cases run, at the first test that needs it.
"""

from __future__ import annotations

import os

import pytest

from .runner import select
from .suite import (
    DEFAULT_MESHES,
    apply_xfail,
    default_xfail,
    load_xfail,
    mesh_name,
    parse_meshes,
    run_suite,
)


def pytest_addoption(parser):
    group = parser.getgroup("twinshard", "FSDP conformance (twinshard)")
    group.addoption(
        "--fsdp-impl", default=None, help="implementation module to check (or env TWINSHARD_IMPL)"
    )
    group.addoption("--fsdp-world-sizes", default=DEFAULT_MESHES, help="meshes, e.g. 1,2,3,2x2")
    group.addoption("--fsdp-cases", default=None, help="comma-separated case name patterns")
    group.addoption("--fsdp-device", default="cpu", choices=("cpu", "cuda"))
    group.addoption("--fsdp-xfail", default=None, help="expected-failures file")
    group.addoption(
        "--fsdp-stand-in-streams",
        action="store_true",
        help="run with stand-in streams and stream-order checks",
    )


def implementation(config) -> str:
    impl = config.getoption("--fsdp-impl") or os.environ.get("TWINSHARD_IMPL")
    if not impl:
        raise pytest.UsageError(
            "twinshard conformance: name the implementation to check with --fsdp-impl MODULE "
            "or the environment variable TWINSHARD_IMPL (e.g. twinshard.reference)"
        )
    return impl


def _settings(config):
    cases = config.getoption("--fsdp-cases")
    return (
        parse_meshes(config.getoption("--fsdp-world-sizes")),
        cases.split(",") if cases else None,
    )


def conformance_params(config) -> list[tuple[str, str]]:
    """(mesh, case) pairs to test, for ``pytest_generate_tests`` in the check module."""
    implementation(config)
    meshes, patterns = _settings(config)
    return [(mesh_name(m), n) for m in meshes for n in select(patterns)]


class _Results:
    """Runs each mesh once, when its first test asks for a result."""

    def __init__(self, config):
        self.config = config
        self.impl = implementation(config)
        self.meshes, self.patterns = _settings(config)
        path = config.getoption("--fsdp-xfail") or default_xfail(self.impl)
        self.expected = load_xfail(path)
        self.rows: dict[tuple[str, str], dict] = {}
        self.tmp = config._tmp_path_factory.mktemp("conformance")
        self.done: set[str] = set()

    def get(self, mesh: str, case: str) -> dict:
        if mesh not in self.done:
            # world size 2 first: the checkpoint cases of other sizes read what it saved
            for shape in self.meshes:
                name = mesh_name(shape)
                if name in self.done:
                    continue
                rows = run_suite(
                    self.impl,
                    [shape],
                    self.patterns,
                    self.config.getoption("--fsdp-device"),
                    tmpdir=str(self.tmp),
                    stand_in_streams=self.config.getoption("--fsdp-stand-in-streams"),
                )
                for r in apply_xfail(rows, self.expected):
                    self.rows[(r["mesh"], r["case"])] = r
                self.done.add(name)
                if name == mesh:
                    break
        return self.rows[(mesh, case)]


@pytest.fixture(scope="session")
def fsdp_conformance(request):
    return _Results(request.config)
