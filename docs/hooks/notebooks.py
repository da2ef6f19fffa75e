"""Execute each tutorial notebook once and keep the executed copy.

The notebooks in tutorials/ are stored with their outputs cleared. The site shows them with
outputs, and CI must run every one of them, but each takes about a minute on a 2-core
machine, so they should run once per change, not once for the tests and again for the site.

``executed_copy(notebook)`` returns the path of an executed copy, running the notebook only
when no copy exists for the same inputs. The cache key covers everything an output can
depend on: the notebook's bytes (and its exercise's answer), every Python file of the package
(twinshard/, reference/, optimized/, conformance/, variants/, benchmarks/), the torch version
and the Python version.
A failing notebook raises ``NotebookFailed`` naming the cell, and leaves nothing in the cache,
so it is tried again (and fails again) next time.

The cache lives in ``build/notebooks/`` (ignored by git); ``TWINSHARD_NOTEBOOK_CACHE`` moves it.
Both the docs build (docs/hooks/twinshard_docs.py) and any test may call ``executed_copy``:
whichever runs first pays for the execution.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import platform
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("twinshard", "reference", "optimized", "conformance", "variants", "benchmarks")
CELL_TIMEOUT_S = 600


class NotebookFailed(RuntimeError):
    """A notebook raised while it was being executed."""


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("TWINSHARD_NOTEBOOK_CACHE", ROOT / "build" / "notebooks"))


def source_digest() -> str:
    """A hash of the code a notebook can import, so that a code change invalidates the cache."""
    import torch

    h = hashlib.sha256(f"torch={torch.__version__} python={platform.python_version()}".encode())
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            h.update(str(path.relative_to(ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def cache_key(notebook: pathlib.Path, sources: str) -> str:
    h = hashlib.sha256(sources.encode())
    h.update(notebook.read_bytes())
    if answer_of(notebook).is_file():
        h.update(answer_of(notebook).read_bytes())
    return h.hexdigest()[:20]


# [Note: exercises run with their answer]
# A notebook may hold one exercise: a code cell tagged "exercise" that the student fills in (as
# stored it raises NotImplementedError). Its answer is kept apart, in answers/<notebook>.py
# beside the notebook, so that a student does not read it by scrolling on. The notebook is run
# (by CI and for the site) with the answer in place of the cell, and the executed copy shows
# the cell as the student gets it again, with the outputs the answer produced after it.
EXERCISE_TAG = "exercise"


def answer_of(notebook: pathlib.Path) -> pathlib.Path:
    return notebook.parent / "answers" / f"{notebook.stem}.py"


def executed_copy(notebook: str | os.PathLike, sources: str | None = None) -> pathlib.Path:
    """Path of ``notebook`` executed top to bottom (from the cache, or run now)."""
    notebook = pathlib.Path(notebook).resolve()
    key = cache_key(notebook, sources or source_digest())
    target = cache_dir() / key / notebook.parent.name / notebook.name  # keeps its folder's name
    if target.is_file():
        return target
    executed = execute(notebook)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write next to the target and rename, so that a run killed midway leaves no half copy.
    with tempfile.NamedTemporaryFile("w", dir=target.parent, suffix=".tmp", delete=False) as f:
        f.write(executed)
    os.replace(f.name, target)
    return target


def execute(notebook: pathlib.Path) -> str:
    """Run every cell in a fresh kernel whose working directory is the notebook's folder (as
    when a user opens it there); return the executed notebook as JSON text."""
    import nbclient
    import nbformat

    nb = nbformat.read(notebook, as_version=4)
    exercises = [c for c in nb.cells if EXERCISE_TAG in c.metadata.get("tags", [])]
    stored = [c.source for c in exercises]
    if exercises:  # see [Note: exercises run with their answer]
        answer = answer_of(notebook)
        if len(exercises) > 1 or not answer.is_file():
            raise NotebookFailed(
                f"{notebook.name}: {len(exercises)} cells tagged '{EXERCISE_TAG}'; a notebook "
                f"holds one, and its answer in {answer} (found: {answer.is_file()})"
            )
        exercises[0].source = answer.read_text(encoding="utf-8")
    start = time.monotonic()
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(notebook.parent)}},
    )
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as error:
        raise NotebookFailed(f"{notebook.name} failed:\n{error}") from None
    except nbclient.exceptions.CellTimeoutError as error:
        raise NotebookFailed(f"{notebook.name} timed out: {error}") from None
    nb.metadata["twinshard"] = {"executed_in_s": round(time.monotonic() - start, 1)}
    for cell, source in zip(exercises, stored):
        cell.source = source  # shown as the student gets it
    return nbformat.writes(nb)
