"""The site as a student reads it, at 1400 and at 420 pixels wide, in headless Chromium.

The schedule tables (tutorials 3, 4 and 6) are about 100 columns wide: a row that wraps breaks
in the middle of a number, so every text output must keep its lines (scrolling sideways inside
its cell) and the page itself must not be wider than the window. Every picture must fit the
column and open at full size; every tutorial has a download link; the concepts page's schedule
pictures are the ones the docs hook drew from the code for this tree, not committed files.
"""

from __future__ import annotations

import re

import pytest
from docs_site import ROOT, load_hook

pytestmark = pytest.mark.timeout(2400)  # the first build executes every tutorial
WIDTHS = (1400, 420)
TABLES = ("03_shard_a_layer", "04_mixed_precision", "06_reference_to_optimized")
PICTURES = ("tutorials/03_shard_a_layer/", "tutorials/06_reference_to_optimized/")
PICTURES += ("tutorials/07_your_own_variant/", "concepts/")


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("tutorial", TABLES)
def test_schedule_tables_keep_every_row_on_one_line(browser, tutorial, width):
    shown = browser(f"/tutorials/{tutorial}/", width)
    tables = [t for t in shown["texts"] if t["lines"] > 5]
    assert tables, f"{tutorial}: no text output of several lines on the page"
    for text in shown["texts"]:
        assert text["white_space"] == "pre" and not text["wrapped"], (tutorial, width, text)
    assert shown["page_width"] <= shown["frame_width"] + 1, (tutorial, width)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("page", PICTURES)
def test_pictures_fit_the_column_and_open_at_full_size(browser, page, width):
    shown = browser(f"/{page}", width)
    pictures = [i for i in shown["images"] if i["width"] > 400]  # not icons
    assert pictures, f"{page}: no picture"
    for picture in pictures:
        assert picture["complete"] and 0 < picture["shown"] <= shown["frame_width"], picture
        assert picture["zoom"], f"{page}: a picture that does not open at full size"
    zoom = shown["zoom"]
    assert zoom and zoom["natural"] > 400 and zoom["shown"] == zoom["natural"], zoom
    assert zoom["closed"], "the full-size view did not close on a click"
    assert shown["page_width"] <= shown["frame_width"] + 1, (page, width)


def test_every_tutorial_can_be_downloaded(site):
    for notebook in sorted((ROOT / "tutorials").glob("*.ipynb")):
        page = site / "tutorials" / notebook.stem
        html_text = (page / "index.html").read_text(encoding="utf-8")
        targets = re.findall(r'<a [^>]*href="([^"]+\.ipynb)"[^>]*download', html_text)
        targets += re.findall(r'<a [^>]*download[^>]*href="([^"]+\.ipynb)"', html_text)
        assert targets, f"{notebook.name}: no download link"
        for target in targets:
            copy = (page / target).resolve()
            assert copy.is_file() and copy.name == notebook.name, target


def test_the_concepts_pictures_are_drawn_from_this_tree(site):
    notebooks, pictures = load_hook("notebooks"), load_hook("pictures")
    sources = notebooks.source_digest()
    assert not list((ROOT / "docs" / "img").glob("schedule_*.png")), "a committed picture"
    for name in pictures.PICTURES:
        built = (site / name).read_bytes()
        assert (
            built[:8] == b"\x89PNG\r\n\x1a\n"
            and built == pictures.drawn(name, sources).read_bytes()
        )
    page = (site / "concepts" / "index.html").read_text(encoding="utf-8")
    assert "0 reduce-scatters" in page and "all-reduces each group" in page  # says what gloo does


def test_the_explorer_is_linked_where_the_schedules_are_taught(site):
    explorer = (site / "explorer" / "index.html").resolve()
    for page in (
        "concepts",
        *(f"tutorials/{t}" for t in TABLES[::2]),
        "tutorials/07_your_own_variant",
    ):
        html_text = (site / page / "index.html").read_text(encoding="utf-8")
        # a link may open one view of it (#setting=...; test_explorer.py checks which)
        targets = re.findall(r'href="([^"#]*explorer[^"#]*)(?:#[^"]*)?"', html_text)
        resolved = {(site / page / t).resolve() for t in targets}
        assert {explorer, explorer.parent} & resolved, (page, targets)


def test_the_code_of_the_site_can_be_taken_home(site):
    """The "Get the code" page links an archive of the commit the site was built from."""
    import subprocess
    import tarfile

    html_text = (site / "source" / "index.html").read_text(encoding="utf-8")
    (target,) = set(re.findall(r'href="(twinshard-[0-9a-f]+\.tar\.gz)"', html_text))
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert head.stdout.startswith(target.removeprefix("twinshard-").removesuffix(".tar.gz"))
    with tarfile.open(site / "source" / target) as packed:
        names = set(packed.getnames())
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    assert {f"twinshard/{name}" for name in tracked.stdout.split()} <= names
