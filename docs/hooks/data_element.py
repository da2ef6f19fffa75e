"""What the pages drawn from a data file share: their element, told where the file is.

The schedule explorer (``explorer.py``) and the memory calculator (``memory.py``) each draw from
one JSON file that the site serves. Their page holds one empty element, such as
``<div class="ts-memory"></div>``, and the page's script fetches the URL that the element's
``data-src`` gives. ``point_at_data`` fills that in, relative to the page as the site goes, and
fails the build, naming the page, when the element or the file is missing.
"""

from __future__ import annotations

from collections.abc import Callable

from mkdocs.exceptions import PluginError
from mkdocs.utils import get_relative_url


def place(kind: str) -> str:
    """The page's empty element for ``kind`` (a CSS class), as markdown renders it."""
    return f'<div class="{kind}"></div>'


def element(kind: str, page_url: str, data_url: str) -> str:
    """The element told where its data is, relative to the page."""
    return f'<div class="{kind}" data-src="{get_relative_url(data_url, page_url)}"></div>'


def point_at_data(html, page, files, *, src: str, kind: str, data: str, check: Callable = None):
    """``html`` with page ``src``'s element pointed at the site's file ``data``; other pages'
    HTML as it is. ``check(file)`` (the site's ``File``, or None where it has none) raises the
    hook's own error for a missing or wrong file; by default a missing one fails the build."""
    if page.file.src_uri != src:
        return html
    if place(kind) not in html:
        raise PluginError(f"{src} has no {place(kind)} for its script to draw in")
    file = files.get_file_from_path(data)
    if check is not None:
        check(file)
    if file is None:
        raise PluginError(f"{src} draws from {data}, which the site does not have")
    return html.replace(place(kind), element(kind, page.url, file.url), 1)
