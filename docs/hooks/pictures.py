"""The pictures the site draws from the code at build time, cached like the notebooks.

A committed picture drifts from the code it shows (the concepts page once showed an optimized
path with reduce-scatters that it no longer issued on gloo). So each picture here is drawn by
the code itself when the site is built, and kept in ``build/pictures/`` (beside the notebooks'
cache, and moved with it by ``TWINSHARD_NOTEBOOK_CACHE``) under a key of everything it can
depend on: ``notebooks.source_digest()`` (the package's source, torch and Python) and the
picture's own recipe. A picture that cannot be drawn fails the build, naming it.

They are drawn as SVG: the schedule is 11 inches wide, so a phone shows it at a third of its
size, and the full-size view (``js/figures.js``) or a pinch then enlarges lines and text that
stay sharp.

``PICTURES`` maps a site path to (the implementation, the caption); ``drawn(name, sources)``
returns the file, drawing it when the cache has none; ``markdown(impls)`` shows the pictures of
those implementations.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import tempfile

import notebooks

GLOO = (
    "Recorded on 2 gloo ranks on the CPU, the tiny Llama with 3 blocks, by `twinshard schedule` "
    "when this site was built. "
)
PICTURES = {
    "img/schedule_reference.svg": (
        "reference",
        GLOO + "Every triangle is one parameter's blocking collective: the reference gathers "
        "a group one parameter at a time and reduce-scatters its gradients the same way.",
    ),
    "img/schedule_optimized.svg": (
        "optimized",
        GLOO + "One all-gather per group, issued a group ahead (hollow: asynchronous; the dot "
        "is where the result was first needed). On gloo, which has no reduce-scatter that "
        "overlaps, the optimized path all-reduces each group's packed gradients in place (the "
        "squares), where on an accelerator it reduce-scatters them: the title counts 0 "
        "reduce-scatters for that reason.",
    ),
}
WORLD, LAYERS = 2, 3


class PictureFailed(RuntimeError):
    """A picture could not be drawn from the code."""


def cache_dir() -> pathlib.Path:
    return notebooks.cache_dir().parent / "pictures"


def drawn(name: str, sources: str) -> pathlib.Path:
    """The file of picture ``name`` (a key of ``PICTURES``), drawn now if not cached."""
    impl, _ = PICTURES[name]
    recipe = f"{name} {impl} world={WORLD} layers={LAYERS}"
    key = hashlib.sha256(f"{sources} {recipe}".encode()).hexdigest()[:20]
    path = cache_dir() / key / pathlib.Path(name).name
    if path.is_file():
        return path
    from twinshard.measure.schedule import plot_timeline, record_step

    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        schedule = record_step(impl, world_size=WORLD, layers=LAYERS)
        handle, scratch = tempfile.mkstemp(suffix=path.suffix, dir=path.parent)
        os.close(handle)
        plot_timeline(schedule, scratch)
    except Exception as error:  # noqa: BLE001 - any failure is the build's, named
        raise PictureFailed(f"{name}: drawing the {impl} schedule failed: {error}") from error
    os.replace(scratch, path)  # whole or not at all: a stopped build leaves no half picture
    return path


def markdown(impls: list[str]) -> str:
    """The pictures of ``impls`` (all of them when empty) with their captions, as a page shows
    them (a button under each opens it at full size)."""
    unknown = set(impls) - {impl for impl, _ in PICTURES.values()}
    if unknown:
        raise PictureFailed(f"no schedule picture of {sorted(unknown)}")
    return "\n\n".join(
        f"![One training step of twinshard.{impl}]({name}){{ .twinshard-figure }}\n*{caption}*"
        for name, (impl, caption) in PICTURES.items()
        if impl in impls or not impls
    )
