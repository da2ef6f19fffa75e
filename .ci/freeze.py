"""Print the constraints CI installs from: the versions installed now of every package that
twinshard's extras bring, and of everything those pull in (torch stays at the project's pin).

Run it in an environment where CI just passed: python3 .ci/freeze.py > .ci/constraints.txt
"""

from __future__ import annotations

import importlib.metadata as metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

EXTRAS = ("dev", "docs", "tutorials", "train", "clients")
PINNED_ELSEWHERE = {"twinshard", "torch", "setuptools"}  # the project, its torch pin, the builder
HEADER = """\
# The versions CI was last green with: every package the extras bring (dev, docs, tutorials,
# train, clients) and what they pull in. .ci/run installs with `-c .ci/constraints.txt`, so a
# release elsewhere cannot fail a clean checkout overnight. Install the same set with
#   python3 -m pip install torch==2.13.0 -c .ci/constraints.txt -e ".[dev,clients]"
# torch is pinned here too, so that no resolution can pull another build.
# Regenerate after a green run with newer versions: python3 .ci/freeze.py > .ci/constraints.txt
torch==2.13.0"""


def closure(name: str, extras: tuple[str, ...], found: dict[str, str]) -> None:
    """Add ``name`` (with ``extras``) and its installed requirements to ``found``."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return  # a requirement of another platform or Python, not installed here
    found.setdefault(canonicalize_name(name), f"{dist.metadata['Name']}=={dist.version}")
    for line in dist.requires or []:
        req = Requirement(line)
        wanted = [{"extra": e} for e in extras] or [{"extra": ""}]
        if req.marker and not any(req.marker.evaluate(env) for env in wanted):
            continue
        if canonicalize_name(req.name) in found and not req.extras:
            continue
        closure(req.name, tuple(req.extras), found)


def main() -> None:
    found: dict[str, str] = {}
    closure("twinshard", EXTRAS, found)
    print(HEADER)
    for key in sorted(found):
        if key not in PINNED_ELSEWHERE:
            print(found[key])


if __name__ == "__main__":
    main()
