"""Every package of ``twinshard/`` names its files in its face (issue 52, item 5): the docstring
of each ``__init__.py`` names each module of its folder (``name.py``) and each package below it
(``name/``), so that a reader who opens a package sees what each of its files owns, and
``twinshard/__init__.py`` names every entry of the top level by the part it belongs to (the
interface, the switch, running ranks, observing them, the applications). A file added without
a line in its package's face fails here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = sorted(p.parent for p in (ROOT / "twinshard").rglob("__init__.py"))


def entries(package: Path) -> list[str]:
    """The modules (``name.py``) and packages (``name/``) of ``package``, its face excepted."""
    modules = [p.name for p in package.glob("*.py") if p.name != "__init__.py"]
    packages = [f"{p.name}/" for p in package.iterdir() if (p / "__init__.py").is_file()]
    return sorted(modules + packages)


def unnamed(package: Path) -> list[str]:
    """The entries of ``package`` that its ``__init__.py`` docstring does not name (a name
    counts where no letter, digit, underscore or dot runs into its start)."""
    face = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    return [e for e in entries(package) if not re.search(rf"(?<![\w.]){re.escape(e)}", face)]


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_package_names_its_files(package):
    assert unnamed(package) == [], (
        f"{package.relative_to(ROOT)}/__init__.py does not name these in its docstring: say "
        "in one line what each owns"
    )


def test_the_face_check_can_fail(tmp_path):
    (tmp_path / "inner").mkdir()
    (tmp_path / "inner" / "__init__.py").write_text("")
    for name in ("run.py", "rerun.py", "my_run.py", "__main__.py"):
        (tmp_path / name).write_text("")
    (tmp_path / "__init__.py").write_text('"""run.py starts it; inner holds the rest."""\n')
    assert unnamed(tmp_path) == ["__main__.py", "inner/", "my_run.py", "rerun.py"]
    (tmp_path / "__init__.py").write_text('"""run.py, rerun.py, my_run.py, inner/."""\n')
    assert unnamed(tmp_path) == ["__main__.py"]
