"""MkDocs hook: points the memory calculator (docs/memory.md) at its data.

The calculator's numbers are ``twinshard plan``'s memory over a grid of settings, recorded by
``benchmarks/memory_calculator.py`` into ``docs/memory/plans.json``, which the site serves as it
is (recording the grid takes about forty minutes, too long for a build: that script's docstring
says why and how the tests keep the file true). This hook gives the page's
``<div class="ts-memory"></div>`` the file's URL relative to the page as ``data-src``, which
``docs/js/memory.js`` fetches. A page without that element, or a site without the file, or a
file without settings, fails the build with what to run.
"""

from __future__ import annotations

import json

from mkdocs.exceptions import PluginError
from mkdocs.utils import get_relative_url

PAGE = "memory.md"
DATA = "memory/plans.json"  # in docs/, served as it is
PLACE = '<div class="ts-memory"></div>'  # the page's element, as markdown renders it
RECORD = "python benchmarks/memory_calculator.py"


def page_element(page_url: str, data_url: str) -> str:
    """The page's element, told where its data is (relative to the page, as the site goes)."""
    where = get_relative_url(data_url, page_url)
    return f'<div class="ts-memory" data-src="{where}"></div>'


def on_page_content(html, page, config, files):
    if page.file.src_uri != PAGE:
        return html
    if PLACE not in html:
        raise PluginError(f"{PAGE} has no {PLACE} for the calculator to draw in")
    data = files.get_file_from_path(DATA)
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
    return html.replace(PLACE, page_element(page.url, data.url), 1)
