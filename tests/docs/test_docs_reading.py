"""The site as a student reads it, at 1400 and at 420 pixels wide, in headless Chromium.

The schedule tables (tutorials 3, 4 and 6) are about 100 columns wide: a row that wraps breaks
in the middle of a number, so every text output must keep its lines (scrolling sideways inside
its cell), a table or text block wider than its cell must scroll there rather than be cut, and
no page may be wider than the window: every built page is checked at both widths. Every
picture must fit the column and be legible: shown at 0.6 of its own width or more, or with a
visible "Tap to enlarge" button under it that opens it at full size (a tooltip alone is not
seen on a phone). Headings keep their code in the navigation and the table of contents. Every
tutorial has a download link; the concepts page's schedule pictures are the ones the docs hook
drew from the code for this tree, not committed files.
"""

from __future__ import annotations

import re

import pytest
from docs_site import MACHINE_PATH, ROOT, load_hook

pytestmark = pytest.mark.timeout(2400)  # the first build executes every tutorial
WIDTHS = (1400, 420)
TABLES = ("03_shard_a_layer", "04_mixed_precision", "06_reference_to_optimized")
PICTURES = ("tutorials/03_shard_a_layer/", "tutorials/06_reference_to_optimized/")
PICTURES += ("tutorials/07_your_own_variant/", "concepts/", "optimized-path/")


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("tutorial", TABLES)
def test_schedule_tables_keep_every_row_on_one_line(browser, tutorial, width):
    shown = browser(f"/tutorials/{tutorial}/", width)
    tables = [t for t in shown["texts"] if t["lines"] > 5]
    assert tables, f"{tutorial}: no text output of several lines on the page"
    for text in shown["texts"]:
        assert text["white_space"] == "pre" and not text["wrapped"], (tutorial, width, text)
    if width == 1400:  # a wide window shows a schedule table whole, not scrolled
        assert all(t["width"] <= t["box"] for t in tables), (tutorial, tables)
    assert shown["page_width"] <= shown["frame_width"] + 1, (tutorial, width)


LEGIBLE = 0.6  # a picture shown at less than this share of its own width needs the button


def legible(picture: dict) -> bool:
    return picture["shown"] >= LEGIBLE * picture["width"] or picture["control"]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("page", PICTURES)
def test_pictures_fit_the_column_and_open_at_full_size(browser, page, width):
    shown = browser(f"/{page}", width)
    pictures = [i for i in shown["images"] if i["width"] > 400]  # not icons
    assert pictures, f"{page}: no picture"
    for picture in pictures:
        assert picture["complete"] and 0 < picture["shown"] <= shown["frame_width"], picture
        assert picture["zoom"], f"{page}: a picture that does not open at full size"
        assert legible(picture), f"{page} at {width} px: a small picture without its button"
    zoom = shown["zoom"]
    assert zoom and zoom["natural"] > 400 and zoom["shown"] == zoom["natural"], zoom
    assert zoom["closed"], "the full-size view did not close on a click"
    if width == 420:  # a phone: the schedules are shrunk, and the button is what opened them
        assert zoom["by"] == "button" and "enlarge" in pictures[0]["control_text"].lower()
    assert shown["page_width"] <= shown["frame_width"] + 1, (page, width)


def built_pages(site) -> list[str]:
    pages = sorted(p.parent.relative_to(site).as_posix() for p in site.rglob("index.html"))
    return ["/" if p == "." else f"/{p}/" for p in pages]


# every page at a phone's width in every run; the wide window (where less can go wrong, and the
# pages with schedules and pictures are checked above) in the full tier
@pytest.mark.parametrize("width", [pytest.param(1400, marks=pytest.mark.full), 420])
def test_no_page_is_wider_than_the_window_or_cuts_what_it_shows(site, browser, width):
    """Every built page, one run of the browser per page."""
    pages = built_pages(site)
    assert len(pages) >= 30 and "/tutorials/03_shard_a_layer/" in pages, pages
    problems = []
    for page, shown in zip(pages, browser(pages, width)):
        if shown["page_width"] > shown["frame_width"] + 1:
            problems.append(f"{page}: {shown['page_width']} px wide in {shown['frame_width']}")
        problems += [f"{page}: cut: {what}" for what in shown["cut"]]
        for text in shown["texts"]:
            if text["white_space"] != "pre" or text["wrapped"]:
                problems.append(f"{page}: a text output wraps: {text['head']!r}")
        for picture in shown["images"]:
            if picture["width"] > 400 and not legible(picture):
                problems.append(f"{page}: a picture shown at {picture['shown']} px of "
                                f"{picture['width']}, without a button to enlarge it")  # fmt: skip
    assert not problems, f"at {width} px:\n" + "\n".join(problems)


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
    assert not list((ROOT / "docs" / "img").glob("schedule_*")), "a committed picture"
    for name in pictures.PICTURES:
        built = (site / name).read_bytes()
        assert b"<svg" in built[:2000] and built == pictures.drawn(name, sources).read_bytes()
    # the concepts page opens on the reference's step: a picture before its second section
    page = (site / "concepts" / "index.html").read_text(encoding="utf-8")
    article = page.split('<article class="md-content__inner md-typeset">', 1)[1]
    sections = article.split("<h2", 2)
    assert len(sections) == 3 and "schedule_reference.svg" in "".join(sections[:2]), sections[0]
    inside = (site / "optimized-path" / "index.html").read_text(encoding="utf-8")
    assert "0 reduce-scatters" in inside and "all-reduces each group" in inside  # gloo's way
    assert "schedule_optimized.svg" in inside


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


HEADING = re.compile(r'<h([1-6])\b[^>]*\bid="([^"]+)"[^>]*>(.*?)</h\1>', re.S)


def codes_in(fragment: str) -> list[str]:
    return re.findall(r"<code[^>]*>(.*?)</code>", fragment, re.S)


def test_headings_keep_their_code_in_the_contents(site):
    """A heading's code (`fully_shard`) is kept, as code, in the page's table of contents and, for
    a page's title, in the site's navigation: "3. Shard one layer by hand, then with" is not a
    title."""
    home = (site / "index.html").read_text(encoding="utf-8")
    checked = {"contents": 0, "navigation": 0}
    for path in sorted(site.rglob("index.html")):
        page = path.read_text(encoding="utf-8")
        article = page.split('<article class="md-content__inner md-typeset">', 1)[-1]
        article = article.split("</article>", 1)[0]
        # the theme lists the first title's sections (a page that includes another's text
        # with its own title, such as benchmarks/results/README.md, lists those no further)
        article = "<h1".join(article.split("<h1", 2)[:2])
        for found in HEADING.finditer(article):
            level, anchor, inner = found.groups()
            cell = article.rfind('class="jp-Cell ', 0, found.start())
            if cell >= 0 and article.startswith('class="jp-Cell jp-CodeCell', cell):
                continue  # a notebook's output, not one of its sections
            codes = codes_in(inner)
            if not codes:
                continue
            where = path.parent.relative_to(site).as_posix()
            if level == "1":
                target = "./" if where == "." else f"{where}/"
                links = re.findall(rf'<a href="{re.escape(target)}" class="md-nav__link[^"]*">'
                                   r"(.*?)</a>", home, re.S)  # fmt: skip
                assert links, f"{where}: no link in the navigation"
                assert all(codes_in(link) == codes for link in links), (where, codes, links)
                checked["navigation"] += 1
            else:
                links = re.findall(rf'<a href="#{re.escape(anchor)}" class="md-nav__link">'
                                   r"(.*?)</a>", page, re.S)  # fmt: skip
                assert links, f"{where}#{anchor}: not in the table of contents"
                assert codes_in(links[0]) == codes, (where, anchor, codes, links[0])
                checked["contents"] += 1
    assert checked["contents"] >= 5 and checked["navigation"] >= 1, checked


def test_no_page_shows_stderr_or_the_machines_paths(site):
    """What test_tutorials.py asks of each executed notebook, asked of every built page: no
    notebook output from stderr, and no path of the machine that built it (an example path
    in the prose would read as one, so the pages use relative ones)."""
    import html

    pages = sorted(site.rglob("*.html"))
    assert len(pages) >= 30
    for page in pages:
        raw = page.read_text(encoding="utf-8", errors="replace")
        raw = re.sub(r"<(script|style)\b.*?</\1>", "", raw, flags=re.S)
        stderr = 'data-mime-type="application/vnd.jupyter.stderr"'
        assert stderr not in raw, f"{page.relative_to(site)} shows a notebook's stderr"
        text = html.unescape(re.sub(r"<[^>]+>", " ", raw))
        paths = re.findall(MACHINE_PATH, text)
        assert not paths, f"{page.relative_to(site)} shows the machine's paths: {paths[:3]}"
