"""MkDocs hook: a heading's code stays code in the table of contents and the navigation.

The markdown ``toc`` extension names each heading by its text with the tags stripped, so
"The same with `fully_shard`" is listed without its code face; mkdocs-jupyter does worse: it
names a notebook's headings from a Markdown copy of it, where a heading's code is lost ("The
same with") and so is its id (the contents linked ``#the-same-with``, a heading that is not
there). Material shows a heading's HTML instead of its name where the heading
(``toc_item.typeset``) or the page (``page.typeset``, in the navigation) carries one. So, from
the rendered page:

- a notebook whose contents name an id that none of its headings has gets its contents again,
  from its headings;
- a heading of the contents that holds code gets the heading's HTML;
- a page whose first heading holds code shows that heading's HTML in the navigation, and its
  text (code included) in the window's title.
"""

from __future__ import annotations

import html
import re

from markdown.extensions.toc import nest_toc_tokens
from mkdocs.structure.toc import get_toc

HEADING = re.compile(r"<h([1-6])\b([^>]*)>(.*?)</h\1>", re.S)
ID = re.compile(r'\bid="([^"]*)"')
# the permalink a heading ends with: the toc extension's, and nbconvert's
PERMALINK = re.compile(r'<a class="(?:headerlink|anchor-link)"[^>]*>.*?</a>', re.S)


def text_of(fragment: str) -> str:
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", fragment)).split())


def anchors(items) -> list:
    found = []
    for item in items:
        found += [item, *anchors(item.children)]
    return found


def on_page_content(html_text, page, config, files):
    headings = [
        (int(level), ID.search(attributes).group(1), PERMALINK.sub("", inner).strip())
        for level, attributes, inner in HEADING.findall(html_text)
        if ID.search(attributes)
    ]
    by_id = {anchor: inner for _, anchor, inner in headings}
    notebook = page.file.src_uri.endswith(".ipynb")
    if notebook and any(item.id not in by_id for item in anchors(page.toc.items)):
        flat = [
            {"level": level, "id": anchor, "name": text_of(inner), "children": []}
            for level, anchor, inner in headings
        ]
        page.toc = get_toc(nest_toc_tokens(flat))
    for item in anchors(page.toc.items):
        if "<code" in by_id.get(item.id, ""):
            item.typeset = {"title": by_id[item.id]}
    first = next((h for h in headings if h[0] == 1), None)
    if first and "<code" in first[2]:
        page.typeset = {"title": first[2]}
        page.title = text_of(first[2])
    return html_text
