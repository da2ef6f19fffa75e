"""The notebooks in tutorials/: stored clean, and each one runs top to bottom without an error.

Each notebook is executed with nbclient in a fresh kernel whose working directory is
tutorials/, as a reader (or the documentation build) would run it. Any error fails the test,
including the assertions of a notebook's last cells. The execution is the documentation
build's (``docs/hooks/notebooks.py``): whichever of the site build and this test comes first
runs the notebook, and the other reads the executed copy, so CI runs each notebook once. Each
notebook's run time is printed and kept as a test property (``pytest -rA`` shows them).
"""

import importlib.util
from pathlib import Path

import nbformat
import pytest

TUTORIALS = Path(__file__).resolve().parents[1] / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("[0-9][0-9]_*.ipynb"))
NOTEBOOK_LIMIT = 240  # seconds for a whole notebook; they take well under a minute on 2 cores


def test_there_are_nine_numbered_notebooks():
    assert [p.name[:2] for p in NOTEBOOKS] == [f"{i:02d}" for i in range(1, 10)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_clean_and_ends_with_checks(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "clear the outputs"
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")
    last = code[-1].source
    assert "assert" in last and "except" not in last, "end with cells that assert the result"


def _notebook_runner():
    path = TUTORIALS.parent / "docs" / "hooks" / "notebooks.py"
    spec = importlib.util.spec_from_file_location("twinshard_docs_notebooks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(NOTEBOOK_LIMIT + 60)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, record_property):
    # raises NotebookFailed, naming the cell, on any error (an assertion included)
    executed = _notebook_runner().executed_copy(path)
    nb = nbformat.read(executed, as_version=4)
    seconds = nb.metadata["twinshard"]["executed_in_s"]
    record_property("seconds", round(seconds, 1))
    print(f"{path.name}: {seconds:.1f} s")
    assert seconds < NOTEBOOK_LIMIT, f"{path.name} took {seconds:.0f} s"
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("all checks passed" in o.get("text", "") for o in outputs)
