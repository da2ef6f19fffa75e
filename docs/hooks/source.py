"""The code the site was built from, for a student to take home: an archive of the commit.

A site is read apart from its repository (a course's mirror, a saved copy), and this tree does
not record where it is hosted. So the build packs the commit it was built from
(``git archive HEAD``) into ``source/twinshard-<commit>.tar.gz`` on the site, and the page
``source.md`` links it, with the repository's address when the build is given one
(``TWINSHARD_REPO_URL``, which also puts the repository link in the header) and a word on
uncommitted changes, which the archive does not hold.
"""

from __future__ import annotations

import os
import pathlib
import subprocess

import notebooks

ROOT = notebooks.ROOT


class SourceFailed(RuntimeError):
    """The tree is not a git checkout, or git could not pack it."""


def git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise SourceFailed(
            f"git {' '.join(args)} failed in {ROOT}: {done.stderr.strip()}; build the site from a "
            "git checkout of twinshard"
        )
    return done.stdout.strip()


def commit() -> str:
    return git("rev-parse", "--short=12", "HEAD")


def archive(folder: pathlib.Path) -> pathlib.Path:
    """``folder/twinshard-<commit>.tar.gz``: the commit's tracked files under ``twinshard/``."""
    name = f"twinshard-{commit()}.tar.gz"
    path = folder / name
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(".part")
        git("archive", "--format=tar.gz", "--prefix=twinshard/", "-o", str(scratch), "HEAD")
        os.replace(scratch, path)
    return path


def markdown(archive_name: str) -> str:
    """What ``<!-- twinshard:source -->`` becomes on the page."""
    url = os.environ.get("TWINSHARD_REPO_URL", "").strip()
    changed = bool(git("status", "--porcelain", "--untracked-files=no"))
    lines = [f"- **The code of this site**: [{archive_name}](source/{archive_name}), commit "
             f"`{commit()}`: every tracked file, the tutorials and these pages included."]  # fmt: skip
    if changed:
        lines.append(
            "- This site was built from a tree with uncommitted changes, which the archive "
            "does not hold."
        )
    if url:
        lines.append(f"- **The repository**: <{url}>")
    else:
        lines.append(
            "- The repository's address was not given to this build (`TWINSHARD_REPO_URL`); "
            "the archive above is the same code."
        )
    return "\n".join(lines)
