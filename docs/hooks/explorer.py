"""MkDocs hook: the schedule explorer's data (docs/explorer.md), recorded from the code at build.

The explorer page steps through recorded training steps; ``explorer_data.py`` beside this hook
records them (``record_grid``: the example job of ``twinshard schedule`` on gloo ranks, every
setting of its ``AXES``) and ``explorer_page.py`` turns them into JSON (``page_data``). This
hook adds that JSON to
the site as ``explorer/schedules.json`` and tells the page where it is: the page's
``<div class="ts-explorer"></div>`` gets the file's relative URL as ``data-src``, which
``docs/js/explorer.js`` fetches. A page without that element, or a recording that fails
(``RecordingFailed`` names the setting), fails the build.

Recording the 72 settings takes a minute or more on a 2-core machine, so it is done once per
change, like the notebooks (``notebooks.py``): the JSON is kept in ``build/explorer/`` (ignored by git;
``TWINSHARD_EXPLORER_CACHE`` moves it) under a key that covers everything a recording can
depend on: the Python files of the package (twinshard/, reference/, optimized/, conformance/,
variants/), the recorder and the page's numbers (``explorer_data.py``, ``explorer_page.py``),
the grid, and the torch and Python versions.
A failed recording leaves nothing in the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import platform
import tempfile
import time

import data_element  # beside this hook: mkdocs puts its folder on sys.path while it loads it
import explorer_data  # beside this hook: mkdocs puts its folder on sys.path while it loads it
import explorer_page
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("twinshard", "reference", "optimized", "conformance", "variants")
PAGE = "explorer.md"
DATA = "explorer/schedules.json"  # where the JSON lands in the site
KIND = "ts-explorer"  # the class of the page's element
PLACE = data_element.place(KIND)


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("TWINSHARD_EXPLORER_CACHE", ROOT / "build" / "explorer"))


def cache_key(axes: dict) -> str:
    """A hash of what the recorded schedules depend on (see the module's docstring)."""
    import torch

    h = hashlib.sha256(f"torch={torch.__version__} python={platform.python_version()}".encode())
    h.update(json.dumps(axes, sort_keys=True).encode())
    for beside in (explorer_data, explorer_page):
        h.update(pathlib.Path(beside.__file__).read_bytes())
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            h.update(str(path.relative_to(ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:20]


def explorer_json(axes: dict | None = None) -> str:
    """The page's JSON for ``axes`` (default: the explorer's ``AXES``), from the cache or
    recorded now; ``RecordingFailed`` if a setting cannot be recorded."""
    axes = axes or explorer_data.AXES
    target = cache_dir() / f"{cache_key(axes)}.json"
    if target.is_file():
        return target.read_text(encoding="utf-8")
    start = time.monotonic()
    recorded = explorer_data.record_grid(explorer_data.grid(axes))
    data = explorer_page.page_data(recorded, axes)
    data["recorded_in_s"] = round(time.monotonic() - start, 1)
    text = json.dumps(data, separators=(",", ":"))
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written next to the target and renamed, so that a build killed midway leaves no half file.
    with tempfile.NamedTemporaryFile("w", dir=target.parent, suffix=".tmp", delete=False) as f:
        f.write(text)
    os.replace(f.name, target)
    return text


def on_files(files, config):
    try:
        text = explorer_json()
    except explorer_data.RecordingFailed as error:
        raise PluginError(str(error)) from None
    files.append(File.generated(config, DATA, content=text))
    return files


def on_page_content(html, page, config, files):
    return data_element.point_at_data(html, page, files, src=PAGE, kind=KIND, data=DATA)
