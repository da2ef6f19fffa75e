"""The documentation site for the tests: built once per session (``mkdocs build --strict``, the
notebooks executed through the cache of docs/hooks/notebooks.py) in the background from the
session's start (``background.py``: the tests that need it run last), served on 127.0.0.1, and
rendered in headless Chromium through a probe page that loads the page under test in a
same-origin frame of a given width and reports what the browser shows: headings, text, every
image with its decoded and its shown size, every text output's layout, and the page's own
width. conftest.py makes ``site``, ``server`` and ``browser`` fixtures of every test module.
Without Chromium the browser tests fail when ``CI`` is set and are skipped otherwise.
"""

from __future__ import annotations

import atexit
import functools
import html
import http.server
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.parse

import background
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# a path of the machine that ran a notebook or built the site, which no reader's machine has
MACHINE_PATH = r"(?:/tmp/|/root/|/home/|/work/|/usr/|site-packages)\S*"
HOOKS = ROOT / "docs" / "hooks"
CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)


def load_hook(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_hook_{name}", HOOKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(HOOKS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(HOOKS))
    return module


def hook_module(name: str):
    """A module beside the hooks, imported by its own name as the hooks import it: the one
    instance they use."""
    sys.path.insert(0, str(HOOKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(HOOKS))


# --- the build, the server and the browser -----------------------------------------------------
_folder: list[pathlib.Path] = []  # where the session's build writes the site


def _build_command(_items) -> list[str]:
    _folder.append(pathlib.Path(tempfile.mkdtemp(prefix="twinshard-site-")))
    atexit.register(shutil.rmtree, _folder[0], ignore_errors=True)
    command = [sys.executable, "-m", "mkdocs", "build", "--strict"]  # no -q: it hides warnings
    return command + ["-f", str(ROOT / "mkdocs.yml"), "-d", str(_folder[0])]


# Built in the background from the start of the session (support/background.py), always with
# the executed notebooks.
background.register(
    "site_build",
    _build_command,
    env={"NO_MKDOCS_2_WARNING": "1", "TWINSHARD_DOCS_NOTEBOOKS": "execute"},
)


@pytest.fixture(scope="session")
def site_build() -> tuple[int, str]:
    return background.result("site_build")


@pytest.fixture(scope="session")
def site(site_build) -> pathlib.Path:
    code, output = site_build
    assert code == 0, f"mkdocs build --strict failed:\n{output[-8000:]}"
    warnings = re.findall(r"^WARNING +- .*$", output, re.M)  # mkdocs' own log lines
    assert not warnings, "\n".join(warnings)
    return _folder[0]


@pytest.fixture(scope="session")
def server(site):
    handler = functools.partial(Quiet, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    thread.join(10)


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="session")
def browser(site, server, tmp_path_factory):
    """``show(path, width)``: what Chromium shows for a page of the site in a window ``width``
    pixels wide, as a dict (see PROBE). ``show([path, ...], width)``: the same for each page in
    turn, in runs of the browser of ``PAGES_PER_RUN`` pages, as a list (without each page's
    text, ids and links)."""
    if CHROMIUM is None:
        message = "Chromium is not installed (Debian: apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(message + "; CI must run the browser tests")
        pytest.skip(message)
    (site / "_probe.html").write_text(PROBE, encoding="utf-8")
    profile = tmp_path_factory.mktemp("chromium-profile")

    def show(path: str | list[str], width: int = 1200) -> dict | list[dict]:
        if not isinstance(path, str) and len(path) > PAGES_PER_RUN:  # in runs that finish
            return [r for i in range(0, len(path), PAGES_PER_RUN)
                    for r in show(path[i:i + PAGES_PER_RUN], width)]  # fmt: skip
        paths = [path] if isinstance(path, str) else list(path)
        query = urllib.parse.urlencode({"page": "\n".join(paths), "width": width,
                                        "full": int(isinstance(path, str))})  # fmt: skip
        # 20 s of the page's own time for the first, 2 s more for each next (a page's loading
        # stops the clock; only its timers and scripts advance it)
        budget = f"--virtual-time-budget={20000 + 2000 * (len(paths) - 1)}"
        dom = run_chromium(profile, "--dump-dom", budget, f"{server}/_probe.html?{query}")
        found = re.search(r'<pre id="result">(.*?)</pre>', dom, re.S)
        assert found, f"the probe page did not report on {paths[:3]}:\n{dom[-2000:]}"
        results = json.loads(html.unescape(found.group(1)))
        assert isinstance(results, list) and len(results) == len(paths), (paths, results)
        for page, result in zip(paths, results):
            assert not result.get("error"), f"{page}: {result['error']}"
        return results[0] if isinstance(path, str) else results

    return show


# Pages per run of the browser. A run through several pages in turn sometimes never reports
# (33 pages, and then 8, ran past the 120 s limit, where each of the 8 alone takes about 1 s);
# one page a run is what stays reliable.
PAGES_PER_RUN = 1


def run_chromium(profile: pathlib.Path, *args: str) -> str:
    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--window-size=1280,1400",
        *args,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"chromium failed ({done.returncode}):\n{done.stderr[-3000:]}"
    return done.stdout


def probe(site, server, profile, name: str, probe_html: str, page: str, width: int, budget_ms: int):
    """What ``probe_html`` (a page that loads ``page`` in a frame ``width`` pixels wide and
    writes a JSON report into ``<pre id="result">``) reported, served from the site as
    ``name``, after ``budget_ms`` of the browser's virtual time; fails on no report or on the
    report's ``error``."""
    (site / name).write_text(probe_html, encoding="utf-8")
    url = f"{server}/{name}?page={page}&width={width}"
    dom = run_chromium(profile, "--dump-dom", f"--virtual-time-budget={budget_ms}", url)
    found = re.search(r'<pre id="result">(.*?)</pre>', dom, re.S)
    assert found, dom[-2000:]
    seen = json.loads(html.unescape(found.group(1)))
    assert not seen.get("error"), seen
    return seen


# Loads each of ?page=PATHS (one a line) in turn in a frame of the same origin, WIDTH pixels
# wide, and once the last has loaded writes a JSON list of reports into <pre id="result">, one a
# page: its title, headings and (with full=1) text, heading ids and links; every picture with its
# decoded size (0 when the browser could not show it), the width it is shown at and whether a
# visible "enlarge" button sits under it; every text output with its white-space rule and
# whether a line of it wrapped (taller than its lines); every table, text block or picture of the
# article that is wider than the box it sits in and cannot be scrolled there ("cut"); how wide
# the page's content is against the frame; and what clicking the first picture's button (or the
# picture, without one) opened: the full-size view of js/figures.js and the size it shows.
PROBE = """<!doctype html><html><body><pre id="result"></pre>
<iframe id="page" style="height:900px;border:0"></iframe>
<script>
const query = new URLSearchParams(location.search);
const pages = query.get("page").split("\\n"), full = query.get("full") === "1";
const frame = document.getElementById("page");
frame.style.width = (query.get("width") || "1200") + "px";
const reports = [];
const visible = (e, win) => !!e && !e.hidden && e.offsetWidth > 0 && e.offsetHeight > 0 &&
  win.getComputedStyle(e).visibility === "visible";
// A block whose border box runs past the visible part of the nearest box that clips it, where
// that box does not scroll (overflow hidden or clip), or whose own content is clipped so.
function cut(doc, win) {
  const found = [];
  const blocks = doc.querySelectorAll("article table, article pre, article img, article svg");
  for (const el of blocks) {
    const style = win.getComputedStyle(el), right = el.getBoundingClientRect().right;
    const name = el.tagName.toLowerCase() + " " + (el.textContent || "").trim().slice(0, 60);
    if (/hidden|clip/.test(style.overflowX) && el.scrollWidth > el.clientWidth + 1) {
      found.push(name + " (its own content clipped)"); continue;
    }
    for (let box = el.parentElement; box && box !== doc.documentElement; box = box.parentElement) {
      const overflow = win.getComputedStyle(box).overflowX;
      if (overflow === "visible") continue;
      const edge = box.getBoundingClientRect().left + box.clientLeft + box.clientWidth;
      if (right > edge + 1 && !/auto|scroll/.test(overflow)) found.push(name);
      if (right > edge + 1 || /auto|scroll/.test(overflow)) break;
    }
  }
  return found;
}
function survey(doc, win) {
  const images = [...doc.querySelectorAll("article img")].map((img) => {
    const button = img.parentElement.querySelector(".twinshard-enlarge");
    return {src: img.getAttribute("src").slice(0, 200), width: img.naturalWidth,
      height: img.naturalHeight, complete: img.complete, shown: img.clientWidth,
      zoom: img.dataset.zoom === "1", control: visible(button, win),
      control_text: button ? button.textContent.trim() : ""};
  });
  const texts = [...doc.querySelectorAll(".jp-OutputArea-output pre")].map((pre) => {
    const style = win.getComputedStyle(pre), lines = pre.textContent.split("\\n").length;
    const height = parseFloat(style.lineHeight) * lines;
    return {white_space: style.whiteSpace, lines: lines, wrapped: pre.scrollHeight > height + 4,
            width: pre.scrollWidth, box: pre.clientWidth, head: pre.textContent.slice(0, 80)};
  });
  const first = doc.querySelector(".jp-RenderedImage img, img.twinshard-figure");
  let zoom = null;
  if (first) {
    const button = first.parentElement.querySelector(".twinshard-enlarge");
    (visible(button, win) ? button : first).click();
    const view = doc.querySelector(".twinshard-zoom img");
    zoom = view ? {shown: view.clientWidth, natural: view.naturalWidth} : {shown: 0, natural: 0};
    zoom.by = visible(button, win) ? "button" : "picture";
    const open = doc.querySelector(".twinshard-zoom");
    if (open) open.click();
    zoom.closed = !doc.querySelector(".twinshard-zoom");
  }
  const article = doc.querySelector("article");
  return {
    title: doc.title,
    text: full && article ? article.innerText : "",
    ids: full ? [...doc.querySelectorAll("[id]")].map((e) => e.id) : [],
    headings: [...doc.querySelectorAll("h1, h2, h3, h4")].map((e) => e.textContent.trim()),
    links: full ? [...doc.querySelectorAll("a[href]")].map((a) => ({
      href: a.getAttribute("href"), download: a.hasAttribute("download"),
      text: a.textContent.trim().slice(0, 60)})) : [],
    images: images,
    texts: texts,
    cut: cut(doc, win),
    page_width: doc.documentElement.scrollWidth,
    frame_width: doc.documentElement.clientWidth,
    zoom: zoom,
    outputs: doc.querySelectorAll(".jp-OutputArea-output").length,
    has_nav: !!doc.querySelector("nav.md-nav"),
  };
}
frame.onload = () => {
  try { reports.push(survey(frame.contentDocument, frame.contentWindow)); }
  catch (e) { reports.push({error: String(e)}); }
  if (reports.length < pages.length) frame.src = pages[reports.length];
  else document.getElementById("result").textContent = JSON.stringify(reports);
};
frame.src = pages[0];
</script></body></html>
"""
