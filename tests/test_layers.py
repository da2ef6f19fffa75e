"""Rules of the package's layering, checked by parsing the code (as ``test_contract.py`` does
for the contract between the trees).

- The optimized path imports nothing from the conformance suite: the suite imports the optimized
  path, and the stand-in streams with their sanitizer live in ``twinshard/standin.py``, which
  both import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OPTIMIZED = sorted((ROOT / "optimized").glob("*.py"))
SUITE = "twinshard.conformance"


def imported_modules(source: str, package: str) -> list[str]:
    """Every module ``source`` (a module of ``package``) imports, relative imports resolved; a
    ``from a import b`` counts as ``a`` and as ``a.b`` (``b`` may be a submodule)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.append(base)
            found += [f"{base}.{alias.name}" for alias in node.names]
    return found


def suite_imports(source: str, package: str = "twinshard.optimized") -> list[str]:
    """The imports of ``source`` that reach into the conformance suite."""
    return sorted(
        {m for m in imported_modules(source, package) if m == SUITE or m.startswith(SUITE + ".")}
    )


@pytest.mark.parametrize("path", OPTIMIZED, ids=lambda p: p.name)
def test_optimized_imports_nothing_from_the_suite(path):
    assert suite_imports(path.read_text()) == [], (
        f"{path.name} imports the conformance suite; shared tools live outside it "
        "(the stand-in streams and their sanitizer: twinshard/standin.py)"
    )


def test_the_suite_check_can_fail():
    made_up = """
import torch
import twinshard.conformance.compare
from twinshard.conformance.stream_check import StreamSanitizer
from twinshard import conformance
from ..conformance import cases
from .streams import streams_for
from twinshard.conformance_like import nothing
def late():
    from twinshard.conformance import run_suite
"""
    assert suite_imports(made_up) == [
        "twinshard.conformance",
        "twinshard.conformance.cases",
        "twinshard.conformance.compare",
        "twinshard.conformance.run_suite",
        "twinshard.conformance.stream_check",
        "twinshard.conformance.stream_check.StreamSanitizer",
    ]
    assert suite_imports("import torch\nfrom .streams import streams_for\n") == []
