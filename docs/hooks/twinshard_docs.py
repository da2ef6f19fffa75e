"""MkDocs hook: the parts of the site that are generated, so that none of them can go stale.

- API source layout: pyproject.toml installs the top-level folders ``reference/`` etc. as
  ``twinshard.reference`` etc.; mkdocstrings reads source files by import name, so
  ``build/api-src/`` gets a tree of links that follows the same mapping.
- Tutorials: every ``tutorials/*.ipynb`` becomes a page under "Tutorials" (navigation built
  from the glob), rendered by mkdocs-jupyter from an executed copy (``notebooks.py``).
  ``TWINSHARD_DOCS_NOTEBOOKS=stored`` renders the notebooks as stored (no outputs), for quick
  previews of the prose; the default, ``execute``, runs each one (cached) and a notebook that
  raises fails the build.
- Placeholders in pages, each an HTML comment alone on a line, replaced at build time:
  ``<!-- twinshard:tutorials -->``          the list of tutorials with their titles
  ``<!-- twinshard:conformance-cases -->``  the conformance cases from their docstrings
  ``<!-- twinshard:torch-mapping -->``      torch's FSDP names against twinshard's (``mapping.py``)
  ``<!-- twinshard:cli ARGS -->``           the ``--help`` of ``twinshard ARGS``
  ``<!-- twinshard:modules PACKAGE -->``    a mkdocstrings block for each module of PACKAGE,
                                           in the order its docstring names them
  ``<!-- twinshard:schedule-pictures [IMPL ...] -->``  the schedules of IMPL (of both without),
                                           drawn from the code at build time
                                           (``pictures.py``, cached)
  ``<!-- twinshard:source -->``             the archive of the commit the site was built from
                                           (``source.py``)
  An unknown placeholder fails the build.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import re
import shutil
import sys

from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

HOOKS = pathlib.Path(__file__).resolve().parent
sys.path.insert(
    0, str(HOOKS)
)  # hooks are loaded by path; their siblings are not importable otherwise

import mapping  # noqa: E402
import notebooks  # noqa: E402
import pictures  # noqa: E402
import source  # noqa: E402

ROOT = notebooks.ROOT
# The notebooks' folder; tests point it elsewhere to build the site around notebooks of their own.
TUTORIALS = pathlib.Path(os.environ.get("TWINSHARD_TUTORIALS", ROOT / "tutorials"))
PLACEHOLDER = re.compile(r"^<!-- twinshard:([a-z-]+)(?: (.*?))? -->$", re.MULTILINE)


# --- the API's source tree ------------------------------------------------------------------
def package_dirs() -> dict[str, str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return pyproject["tool"]["setuptools"]["package-dir"]


def api_source_tree(tree: pathlib.Path = ROOT / "build" / "api-src") -> pathlib.Path:
    """Link each import name's folder under ``tree`` (``tree/twinshard/reference`` ->
    ``reference/``), so that a static reader finds every module by its import name."""
    shutil.rmtree(tree, ignore_errors=True)
    mapping = package_dirs()
    for name in sorted(mapping, key=lambda n: n.count(".")):
        source, target = ROOT / mapping[name], tree.joinpath(*name.split("."))
        if target.exists():
            continue  # inside a folder that is already linked (conformance/planted)
        if "." not in name:  # a top-level package: a real folder, so subpackages fit inside
            target.mkdir(parents=True)
            for entry in source.iterdir():
                if entry.name != "__pycache__":
                    (target / entry.name).symlink_to(entry)
        else:
            target.symlink_to(source, target_is_directory=True)
    return tree


# --- tutorials ----------------------------------------------------------------------------------
def tutorial_notebooks() -> list[pathlib.Path]:
    return sorted(TUTORIALS.glob("*.ipynb"))


def notebook_summary(path: pathlib.Path) -> tuple[str, str]:
    """(title, first paragraph) from the notebook's first markdown cell."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    text = next(("".join(c["source"]) for c in cells if c["cell_type"] == "markdown"), "")
    title, lines = path.stem, []
    for line in text.splitlines():
        if line.startswith("# ") and title == path.stem:
            title = line[2:].strip()
        elif line.strip() and not line.startswith("#"):
            lines.append(line.strip())
        elif lines:
            break
    return title, " ".join(lines)


@event_priority(100)  # before mkdocstrings reads its paths
def on_config(config):
    """Lay out the API's sources; put each notebook under "Tutorials" in the navigation."""
    api_source_tree()
    for i, item in enumerate(config["nav"]):
        if isinstance(item, dict) and "Tutorials" in item:
            index = item["Tutorials"]
            pages = [
                {notebook_summary(nb)[0]: f"tutorials/{nb.name}"} for nb in tutorial_notebooks()
            ]
            config["nav"][i] = {"Tutorials": [{"Overview": index}, *pages]}
            return config
    raise PluginError("mkdocs.yml: the navigation has no 'Tutorials' entry for the notebooks")


@event_priority(100)  # before mkdocs-jupyter looks at the files
def on_files(files, config):
    mode = os.environ.get("TWINSHARD_DOCS_NOTEBOOKS", "execute")
    if mode not in ("execute", "stored"):
        raise PluginError(f"TWINSHARD_DOCS_NOTEBOOKS must be 'execute' or 'stored', not {mode!r}")
    sources = notebooks.source_digest() if mode == "execute" else None
    for nb in tutorial_notebooks():
        try:
            path = notebooks.executed_copy(nb, sources) if mode == "execute" else nb
        except notebooks.NotebookFailed as error:
            raise PluginError(str(error)) from None
        if path.parent.name != "tutorials":
            raise PluginError(f"{path}: notebooks must sit in a folder named 'tutorials'")
        # A File rooted at the copy's grandparent, not File.generated: mkdocs-jupyter's wrapper
        # only finds the source path of files that have a source folder.
        files.append(
            File(
                f"tutorials/{nb.name}",
                src_dir=str(path.parent.parent),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    for name in pictures.PICTURES:
        try:
            path = pictures.drawn(name, sources or notebooks.source_digest())
        except pictures.PictureFailed as error:
            raise PluginError(str(error)) from None
        files.append(File.generated(config, name, abs_src_path=str(path)))
    try:
        packed = source.archive(ROOT / "build" / "source")
    except source.SourceFailed as error:
        raise PluginError(str(error)) from None
    files.append(File.generated(config, f"source/{packed.name}", abs_src_path=str(packed)))
    SOURCE_ARCHIVE[0] = packed.name
    return files


SOURCE_ARCHIVE = [""]  # the archive's name, for the page that links it


def tutorials_list() -> str:
    found = tutorial_notebooks()
    if not found:
        return "*No notebook is in `tutorials/` yet.*"
    rows = []
    for nb in found:
        title, summary = notebook_summary(nb)
        rows.append(f"1. [{title}]({nb.name}){': ' + summary if summary else ''}")
    return "\n".join(rows)


# --- conformance cases ------------------------------------------------------------------------
def conformance_cases() -> str:
    from twinshard.conformance.cases import CASES

    rows = ["| case | group | what it checks |", "| --- | --- | --- |"]
    for name, case in CASES.items():
        if not case.doc:
            raise PluginError(f"conformance case '{name}' has no docstring to list on the site")
        doc = " ".join(case.doc.split("\n\n")[0].split()).replace("|", "\\|")
        rows.append(f"| `{name}` | {case.group} | {doc} |")
    return "\n".join(rows)


# --- every module of a package ----------------------------------------------------------------
def module_blocks(package: str) -> str:
    """``::: package.module`` for each module file, in the order the package docstring first
    mentions ``module.py`` (its reading order), then the rest alphabetically."""
    folder = ROOT / package_dirs()[package]
    init = (folder / "__init__.py").read_text(encoding="utf-8")
    names = sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")
    if not names:
        raise PluginError(f"{package} has no modules to document in {folder}")
    position = {n: init.find(f"{n}.py") if f"{n}.py" in init else len(init) for n in names}
    ordered = sorted(names, key=lambda n: (position[n], n))
    return "\n".join(f"::: {package}.{n}\n    options:\n      heading_level: 3\n" for n in ordered)


# --- CLI help ----------------------------------------------------------------------------------
def cli_help(args: str) -> str:
    """What ``twinshard ARGS --help`` prints, from the real entry point, run in this process
    (a subprocess per command would import torch again each time)."""
    from twinshard.cli import main

    out = io.StringIO()
    os.environ.setdefault("COLUMNS", "100")  # argparse wraps to this width
    with contextlib.redirect_stdout(out):
        try:
            main([*args.split(), "--help"])
        except SystemExit as stop:
            if stop.code not in (0, None):
                raise PluginError(f"`twinshard {args} --help` exited with {stop.code}") from None
    if not out.getvalue().strip():
        raise PluginError(f"`twinshard {args} --help` printed nothing")
    return f"```text\n$ twinshard {args} --help\n{out.getvalue().rstrip()}\n```"


# --- the placeholders --------------------------------------------------------------------------
def on_page_markdown(markdown, page, config, files):
    def fill(match: re.Match) -> str:
        name, args = match.group(1), match.group(2) or ""
        if name == "tutorials":
            return tutorials_list()
        if name == "conformance-cases":
            return conformance_cases()
        if name == "torch-mapping":
            return mapping.markdown()
        if name == "cli":
            return cli_help(args)
        if name == "modules":
            return module_blocks(args)
        if name == "schedule-pictures":
            try:
                return pictures.markdown(args.split())
            except pictures.PictureFailed as error:
                raise PluginError(f"{page.file.src_uri}: {error}") from None
        if name == "source":
            return source.markdown(SOURCE_ARCHIVE[0])
        raise PluginError(f"{page.file.src_uri}: unknown placeholder 'twinshard:{name}'")

    return PLACEHOLDER.sub(fill, markdown)


# --- a download link on every tutorial page -----------------------------------------------------
ARTICLE = '<article class="md-content__inner md-typeset">'


def on_post_page(output, page, config):
    """Put a link to the notebook itself (mkdocs-jupyter's ``include_source`` copies it beside
    the page) at the top of every tutorial, so a student can run it at home."""
    name = pathlib.PurePosixPath(page.file.src_uri)
    if name.parent.as_posix() != "tutorials" or name.suffix != ".ipynb":
        return output
    if ARTICLE not in output:
        raise PluginError(f"{page.file.src_uri}: no article to put the download link in")
    link = (
        f'<p class="twinshard-download"><a href="{name.name}" download class="md-button">'
        f"Download this notebook ({name.name})</a></p>"
    )
    return output.replace(ARTICLE, ARTICLE + link, 1)
