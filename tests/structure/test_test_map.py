"""tests/README.md maps every test file: each ``test_*.py`` under tests/ is named in the section
of its folder, and every file the map names exists there. A new test file without a line in the
map, or a map line for a file that moved, fails here."""

from __future__ import annotations

import pathlib
import re

TESTS = pathlib.Path(__file__).resolve().parents[1]


def sections(text: str) -> dict[str, str]:
    """The map's sections: folder -> its text (a section starts with **`folder/`: ...**)."""
    parts = re.split(r"^\*\*`([a-z_]+)/`:", text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def unmapped(text: str, files: list[pathlib.Path]) -> tuple[list[str], list[str]]:
    """(test files the map does not name in their folder's section, files it names that are
    not in that folder)."""
    found = sections(text)
    missing = [
        f"{f.parent.name}/{f.name}"
        for f in files
        if not re.search(rf"`{re.escape(f.name)}`", found.get(f.parent.name, ""))
    ]
    present = {(f.parent.name, f.name) for f in files}
    stale = [
        f"{folder}/{name}"
        for folder, body in found.items()
        for name in re.findall(r"`(test_[a-z0-9_]+\.py)`", body)
        if (folder, name) not in present
    ]
    return missing, stale


def test_every_test_file_is_in_the_map():
    files = sorted(p for p in TESTS.glob("*/test_*.py"))
    missing, stale = unmapped((TESTS / "README.md").read_text(), files)
    assert not missing, f"name these in tests/README.md's map, under their folder: {missing}"
    assert not stale, f"tests/README.md names files that are not there: {stale}"
    assert not list(TESTS.glob("test_*.py")), "a test file goes in a folder by area"


def test_the_map_check_can_fail(tmp_path):
    for folder, name in (("suite", "test_a.py"), ("suite", "test_b.py"), ("engine", "test_c.py")):
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / name).write_text("")
    files = sorted(tmp_path.glob("*/test_*.py"))
    text = "**`suite/`: the suite.** `test_a.py`, `test_gone.py`.\n\n**`engine/`:** `test_b.py`\n"
    assert unmapped(text, files) == (
        ["engine/test_c.py", "suite/test_b.py"],
        ["suite/test_gone.py", "engine/test_b.py"],
    )
