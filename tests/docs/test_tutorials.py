"""The notebooks in tutorials/: stored clean, and each one runs top to bottom without an error.

Each notebook is executed with nbclient in a fresh kernel whose working directory is
tutorials/, as a reader (or the documentation build) would run it. Any error fails the test,
including the assertions of a notebook's last cells. The execution is the documentation
build's (``docs/hooks/notebooks.py``): this test waits for the session's site build (started in
the background, ``support/docs_site.py``) and reads the copy it executed, so CI runs each
notebook once; without that copy (a build that stopped early) it runs the notebook itself. Each
notebook's run time is printed and kept as a test property (``pytest -rA`` shows them).
"""

import importlib.util
import re
from pathlib import Path

import nbformat
import pytest
from docs_site import MACHINE_PATH

TUTORIALS = Path(__file__).resolve().parents[2] / "tutorials"
REFERENCE = TUTORIALS.parent / "reference"
NOTEBOOKS = sorted(TUTORIALS.glob("[0-9][0-9]_*.ipynb"))
NOTEBOOK_LIMIT = 240  # seconds for a whole notebook; they take well under a minute on 2 cores


def test_there_are_thirteen_numbered_notebooks():
    assert [p.name[:2] for p in NOTEBOOKS] == [f"{i:02d}" for i in range(1, 14)]


def test_an_exercise_is_stored_unanswered_with_its_answer_apart():
    """An exercise cell (tutorials 10 to 13) raises until the student writes it; the answer the
    notebook runs with (docs/hooks/notebooks.py) defines the same function, and is not in the
    notebook."""
    exercised = 0
    for path in NOTEBOOKS:
        cells = nbformat.read(path, as_version=4).cells
        tagged = [c for c in cells if "exercise" in c.metadata.get("tags", [])]
        if not tagged:
            continue
        exercised += 1
        (cell,) = tagged
        assert "raise NotImplementedError" in cell.source, path.name
        answer = (TUTORIALS / "answers" / f"{path.stem}.py").read_text(encoding="utf-8")
        kind, name = re.search(r"^(def|class) (\w+)\(", cell.source, re.M).groups()
        assert f"{kind} {name}(" in answer and "NotImplementedError" not in answer
        body = answer.split(f"{kind} {name}(", 1)[1]
        assert all(body not in c.source for c in cells), f"{path.name} holds its own answer"
    assert exercised >= 4, "fewer than four notebooks ask the student to write something"


def test_an_exercise_runs_with_its_answer_and_is_shown_without_it(tmp_path, monkeypatch):
    notebooks = _notebook_runner()
    monkeypatch.setenv("TWINSHARD_NOTEBOOK_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "tutorials"
    (folder / "answers").mkdir(parents=True)
    nb = nbformat.v4.new_notebook()
    stub = "def answer():\n    raise NotImplementedError('yours')"
    nb.cells = [nbformat.v4.new_code_cell(stub), nbformat.v4.new_code_cell("assert answer() == 42")]
    nb.cells[0].metadata["tags"] = ["exercise"]
    nbformat.write(nb, folder / "ex.ipynb")
    with pytest.raises(notebooks.NotebookFailed, match="its answer in"):
        notebooks.executed_copy(folder / "ex.ipynb", "code")  # no answer file yet
    (folder / "answers" / "ex.py").write_text("def answer():\n    return 42\n")
    executed = nbformat.read(notebooks.executed_copy(folder / "ex.ipynb", "code"), as_version=4)
    assert executed.cells[0].source == stub  # shown as the student gets it
    (folder / "answers" / "ex.py").write_text("def answer():\n    return 41\n")  # wrong
    with pytest.raises(notebooks.NotebookFailed, match="assert answer"):
        notebooks.executed_copy(folder / "ex.ipynb", "code")  # a new answer runs again


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
def test_notebook_runs(path, record_property, site_build):
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
    # what a reader sees: no warnings on stderr, and none of the build machine's paths
    stderr = [o.get("text", "")[:300] for o in outputs if o.get("name") == "stderr"]
    assert not stderr, f"{path.name} shows stderr: {stderr[:2]}"
    shown = "\n".join(
        o.get("text", "") + str(o.get("data", {}).get("text/plain", "")) for o in outputs
    )
    paths = re.findall(MACHINE_PATH, shown)
    assert not paths, f"{path.name} shows the build machine's paths: {paths[:3]}"


def _answer_lines(path: Path) -> set[str]:
    """The code of a notebook's exercise answer that no stored notebook shows the student (the
    exercise's signature and docstring are shown, and so is a wrong ring): each line without
    its comment, where it is long enough to be the answer's own."""
    answer = TUTORIALS / "answers" / f"{path.stem}.py"
    if not answer.is_file():
        return set()
    shown = "\n".join(c.source for p in NOTEBOOKS for c in nbformat.read(p, as_version=4).cells)
    # The reference is the specification, and the site shows its source: an exercise that
    # writes its hooks again (tutorial 12) may share its lines.
    shown += "\n".join(p.read_text(encoding="utf-8") for p in REFERENCE.rglob("*.py"))
    code = {line.split("#")[0].strip() for line in answer.read_text(encoding="utf-8").splitlines()}
    return {line for line in code if len(line) >= 24 and line not in shown}


def test_no_answer_is_shown_in_any_output_or_page(site):
    """Nothing of an exercise's answer appears in an executed notebook's outputs (the site's
    pages and the downloadable notebooks are made from them) or in any built page."""
    import html

    answers = {p.name: _answer_lines(p) for p in NOTEBOOKS if _answer_lines(p)}
    assert answers, "no exercise has an answer to look for"
    runner = _notebook_runner()
    for path in NOTEBOOKS:
        nb = nbformat.read(runner.executed_copy(path), as_version=4)
        shown = "\n".join(
            o.get("text", "") + str(o.get("data", {}).get("text/plain", ""))
            for c in nb.cells
            if c.cell_type == "code"
            for o in c.outputs
        )
        for name, lines in answers.items():
            leaked = sorted(line for line in lines if line in shown)
            assert not leaked, f"{path.name}'s outputs show {name}'s answer: {leaked[:3]}"
    for page in site.rglob("*"):
        if page.suffix not in (".html", ".ipynb", ".md", ".txt") or not page.is_file():
            continue
        text = html.unescape(page.read_text(encoding="utf-8", errors="replace"))
        for name, lines in answers.items():
            leaked = sorted(line for line in lines if line in text)
            assert not leaked, f"{page.relative_to(site)} shows {name}'s answer: {leaked[:3]}"
