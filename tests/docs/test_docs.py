"""The documentation site: built strictly, served on 127.0.0.1 and rendered in headless Chromium.

The build, the server and the browser are ``docs_site.py``'s fixtures, shared by every test
module that reads the site (this one and ``test_docs_reading.py``): one build per session.
"""

from __future__ import annotations

import base64
import functools
import importlib
import json
import os
import pathlib
import re
import urllib.parse

import pytest
from docs_site import ROOT, load_hook

# The notebooks the site is built around (the hook reads the same variable; unset in CI).
TUTORIALS = pathlib.Path(os.environ.get("TWINSHARD_TUTORIALS", ROOT / "tutorials"))
# The first build executes every tutorial (about a minute each on 2 cores) inside the fixture.
pytestmark = pytest.mark.timeout(2400)


# --- the build -----------------------------------------------------------------------------------
def nav_pages() -> list[str]:
    """Site paths of the pages that mkdocs.yml's nav and the tutorials glob promise."""
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = config.split("\nnav:\n", 1)[1]
    files = re.findall(r"^\s+- [^:]+: ([\w/.-]+\.md)\b", nav, re.M)
    assert len(files) >= 10, f"mkdocs.yml's nav lists {files}"
    pages = ["" if f == "index.md" else f.removesuffix("index.md").removesuffix(".md") + "/"
             for f in files]  # fmt: skip
    pages = [p.replace("//", "/") for p in pages]
    return pages + [f"tutorials/{nb.stem}/" for nb in sorted(TUTORIALS.glob("*.ipynb"))]


def test_every_page_is_built(site):
    missing = [p for p in nav_pages() if not (site / p / "index.html").is_file()]
    assert not missing, f"pages missing from the site: {missing}"


def test_concepts_include_the_reference_source(site):
    """The concepts page shows code from reference/ as it is now (snippets, not copies)."""
    text = page_text(site / "concepts" / "index.html")
    for name in ("collectives.py", "sharded_param.py", "param_group.py", "state.py"):
        source = (ROOT / "reference" / name).read_text(encoding="utf-8")
        defs = re.findall(r"^\s*(def \w+\(.*)$", source, re.M)
        assert defs, name
        for line in defs:
            assert line.strip() in text, f"concepts page lacks reference/{name}: {line.strip()!r}"


def test_home_page_gives_the_readme_commands_one_step_a_line(site):
    """Each step of the README's commands (one line there, joined by ``&&``, so that CI can run
    it as written) is a line of its own in a code block of the home page, where a phone shows
    it whole; ``python3 -m twinshard.cli X`` may be shown as the installed ``twinshard X``."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("[start:commands]", 1)[1].split("[end:commands]", 1)[0]
    commands = re.findall(r"^python3 -m pip install .*$", section, re.M)
    assert len(commands) >= 2
    page = (site / "index.html").read_text(encoding="utf-8")
    blocks = re.findall(r"<pre[^>]*>(.*?)</pre>", page, re.S)
    lines = {line.strip() for block in blocks for line in page_text_of(block).splitlines()}
    for command in commands:
        for step in command.split(" && "):
            shown = {step, step.replace("python3 -m twinshard.cli ", "twinshard ")}
            assert shown & lines, f"the home page lacks the README step {step!r} on a line"
    assert not [line for line in lines if " && " in line], "a home page line chains steps"


def test_internal_links_resolve(site):
    """Every relative link and image of every page, notebooks included, points into the site."""
    broken = []
    for page in site.rglob("*.html"):
        html_text = page.read_text(encoding="utf-8", errors="replace")
        for target in re.findall(r'(?:href|src)="([^"#?]+)', html_text):
            if re.match(r"^(?:[a-z]+:|//)", target):
                continue  # another site, a data: URI, mailto:
            base = site if target.startswith("/") else page.parent  # 404.html links from the root
            path = (base / urllib.parse.unquote(target).lstrip("/")).resolve()
            if path.is_dir():
                path = path / "index.html"
            if not path.exists():
                broken.append(f"{page.relative_to(site)} -> {target}")
    assert not broken, "broken links:\n" + "\n".join(broken[:40])


def test_conformance_page_lists_every_case(site):
    from twinshard.conformance.cases import CASES

    text = page_text(site / "conformance" / "index.html")
    missing = [name for name in CASES if name not in text]
    assert not missing, f"cases missing from the conformance page: {missing}"


def test_torch_mapping_covers_torch_and_agrees_with_introspection(site):
    """One row per torch name and FSDPModule method; 'missing' exactly where twinshard lacks it."""
    import torch.distributed.fsdp as fsdp
    import torch.nn as nn

    import twinshard.optimized
    import twinshard.reference

    html_text = (site / "torch-mapping" / "index.html").read_text(encoding="utf-8")
    rows = {}
    for row in re.findall(r"<tr>(.*?)</tr>", html_text, re.S):
        cells = [page_text_of(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
        if cells:
            rows[cells[0]] = cells[1:]
    methods = [
        f"FSDPModule.{m}"
        for m in dir(fsdp.FSDPModule)
        if not m.startswith("_") and not hasattr(nn.Module, m)
    ]
    assert set(rows) == set(fsdp.__all__) | set(methods)
    for name, cells in rows.items():
        for impl, cell in zip((twinshard.reference, twinshard.optimized), cells):
            has = functools.reduce(lambda o, part: getattr(o, part, None), name.split("."), impl)
            assert cell.startswith("missing") == (has is None), (name, impl.__name__, cell)


def test_torch_mapping_notes_are_attached_to_real_names():
    mapping = load_hook("mapping")
    names = {name for name, _ in mapping.rows()}
    for name, impl in mapping.NOTES:
        assert name in names, f"note for {name!r}, which torch.distributed.fsdp does not have"
        for impl_name in [impl] if impl else mapping.IMPLS:
            assert impl_name in mapping.IMPLS, impl_name
            module = importlib.import_module(impl_name)
            has = functools.reduce(lambda o, part: getattr(o, part, None), name.split("."), module)
            assert has is not None, f"note for {name!r}, which {impl_name} does not have"


# --- notebooks -----------------------------------------------------------------------------------
def test_a_failing_notebook_fails_and_is_not_cached(tmp_path, monkeypatch):
    notebooks = load_hook("notebooks")
    monkeypatch.setenv("TWINSHARD_NOTEBOOK_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "tutorials"
    folder.mkdir()
    good, bad = folder / "good.ipynb", folder / "bad.ipynb"
    write_notebook(good, ["x = 6 * 7", "print(x)"])
    write_notebook(bad, ["assert 1 == 2, 'planted failure'"])
    with pytest.raises(notebooks.NotebookFailed, match="planted failure"):
        notebooks.executed_copy(bad, "code")
    assert not list((tmp_path / "cache").rglob("bad.ipynb"))
    copy = notebooks.executed_copy(good, "code")
    outputs = json.loads(copy.read_text())["cells"][1]["outputs"]
    assert "".join(outputs[0]["text"]) == "42\n"
    stamp = copy.stat().st_mtime_ns
    assert notebooks.executed_copy(good, "code") == copy and copy.stat().st_mtime_ns == stamp
    assert notebooks.executed_copy(good, "other code") != copy  # the code changed: run again


def write_notebook(path: pathlib.Path, cells: list[str]) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nbformat.write(nb, path)


# --- in the browser ------------------------------------------------------------------------------
def test_api_page_lists_fully_shard(browser):
    for impl in ("reference", "optimized"):
        shown = browser(f"/api/{impl}/")
        assert shown["has_nav"], "the page rendered without the site's navigation"
        anchor = f"twinshard.{impl}.fully_shard.fully_shard"
        assert anchor in shown["ids"], f"no entry for fully_shard on the {impl} API page"
        assert any(h.startswith("fully_shard") for h in shown["headings"]), shown["headings"]
        assert "reshard_after_forward" in shown["text"]  # its docstring is shown too


def test_interface_page_renders_fsdp_module(site, browser):
    """The anchor the implementation pages link to exists, and it holds the methods' specs."""
    for impl in ("reference", "optimized"):
        html_text = (site / "api" / impl / "index.html").read_text(encoding="utf-8")
        assert "interface/#twinshard.api.FSDPModule" in html_text, impl
    shown = browser("/api/interface/")
    assert "twinshard.api.FSDPModule" in shown["ids"]
    for method in (
        "unshard",
        "reshard",
        "set_requires_gradient_sync",
        "set_modules_to_forward_prefetch",
    ):
        assert f"twinshard.api.fsdp_module.FSDPModule.{method}" in shown["ids"], method


def test_home_page_renders(browser):
    shown = browser("/")
    assert shown["title"].startswith("twinshard")
    text = shown["text"]
    assert "twinshard train" in text and "python3 -m coverage run -m pytest" in text
    # the first screen says what twinshard is and how to start; CI's pins come after
    assert text.index("twinshard train") < text.index("constraints.txt"), text[:600]


def schedule_notebook() -> tuple[pathlib.Path, list[str]]:
    """The first tutorial that draws the schedule view, and the PNG images it outputs."""
    notebooks = load_hook("notebooks")
    found = sorted(TUTORIALS.glob("*.ipynb"))
    assert found, f"no notebook in {TUTORIALS}"
    for nb in found:
        cells = json.loads(notebooks.executed_copy(nb).read_text(encoding="utf-8"))["cells"]
        images, schedule_images = [], 0
        for cell in cells:
            if cell["cell_type"] != "code":
                continue
            pngs = [
                o["data"]["image/png"]
                for o in cell.get("outputs", [])
                if "image/png" in o.get("data", {})
            ]
            images += ["".join(p).replace("\n", "") for p in pngs]
            if "schedule" in "".join(cell["source"]):
                schedule_images += len(pngs)
        if schedule_images:
            return nb, images
    pytest.fail(
        "no tutorial shows a schedule picture: no code cell mentioning 'schedule' "
        "has an image output"
    )


def test_tutorial_page_shows_its_outputs(site, browser):
    nb, images = schedule_notebook()
    shown = browser(f"/tutorials/{nb.stem}/")
    assert shown["has_nav"], "the notebook page rendered without the site's navigation"
    assert shown["outputs"] > 0, f"{nb.name}: the page shows no cell output"
    drawn = [i for i in shown["images"] if i["complete"] and i["width"] > 0 and i["height"] > 0]
    assert len(drawn) == len(shown["images"]), (
        f"images the browser could not show: {shown['images']}"
    )
    for png in images:  # each picture the notebook made, the schedule among them, is on the page
        assert base64.b64decode(png)[:8] == b"\x89PNG\r\n\x1a\n"
        assert any(
            i["src"].startswith("data:image/png;base64,")
            and png.startswith(i["src"].split(",", 1)[1][:100])
            for i in drawn
        ), f"{nb.name}: a picture is not shown"


# --- helpers -------------------------------------------------------------------------------------
def page_text(path: pathlib.Path) -> str:
    return page_text_of(path.read_text(encoding="utf-8"))


def page_text_of(fragment: str) -> str:
    import html

    return html.unescape(re.sub(r"<[^>]+>", "", fragment)).strip()
