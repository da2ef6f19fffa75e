"""MkDocs hook: points the memory calculator (docs/memory.md) at its data.

The calculator's numbers are ``twinshard plan``'s memory over a grid of settings, recorded by
``benchmarks/memory_calculator.py`` into ``docs/memory/plans.json``, which the site serves as it
is (recording the grid takes about forty minutes, too long for a build: that script's docstring
says why and how the tests keep the file true). This hook gives the page's
``<div class="ts-memory"></div>`` (``data_element.py``) the file's URL relative to the page as ``data-src``, which
``docs/js/memory.js`` fetches. A page without that element, or a site without the file, or a
file without settings, fails the build with what to run.
"""

from __future__ import annotations

import json

import data_element  # beside this hook: mkdocs puts its folder on sys.path while it loads it
from mkdocs.exceptions import PluginError

PAGE = "memory.md"
DATA = "memory/plans.json"  # in docs/, served as it is
KIND = "ts-memory"  # the class of the page's element
PLACE = data_element.place(KIND)
RECORD = "python benchmarks/memory_calculator.py"


def check_data(data) -> None:
    """Fails the build unless ``data`` (the site's file, or None) holds settings."""
    if data is None:
        raise PluginError(f"docs/{DATA} is missing: run `{RECORD}` to record it")
    try:
        settings = json.loads(data.content_string)["settings"]
    except (ValueError, KeyError) as error:
        raise PluginError(
            f"docs/{DATA} is not the calculator's data ({error}): run `{RECORD}`"
        ) from None
    if not settings:
        raise PluginError(f"docs/{DATA} has no settings: run `{RECORD}`")


def on_page_content(html, page, config, files):
    return data_element.point_at_data(
        html, page, files, src=PAGE, kind=KIND, data=DATA, check=check_data
    )
