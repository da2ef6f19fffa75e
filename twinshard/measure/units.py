"""How the measuring reports write numbers, tables and pictures, the same in every report.

Memory in binary units (``MiB``, ``GiB``; ``human_bytes`` picks one) or in millions of bytes
(``MB``), seconds as milliseconds (``ms``), ratios as ``1.23x`` (``ratio``), markdown tables,
and figures written to a file and closed (``figure``).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

MB, MiB, GiB = 1e6, 2**20, 2**30


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def ms(seconds: float, digits: int = 1) -> str:
    """0.01234 -> '12.3'."""
    return f"{seconds * 1e3:.{digits}f}"


def ratio(x: float | None) -> str:
    """1.234 -> '1.23x'; '-' where there is none (None or NaN)."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}x"


def markdown_table(head: list[str], rows: list[list[str]], align: str = "") -> str:
    """The header, its rule and one line per row of cells; ``align`` has an ``r`` for each
    column aligned right (``"lrr"``), any other letter or none for the left."""
    rule = ["---:" if a == "r" else "---" for a in align.ljust(len(head))]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(rule) + "|"]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


@contextmanager
def figure(path: str, dpi: int, *grid, **options):
    """``matplotlib.pyplot.subplots(*grid, **options)`` as (figure, axes) to draw on in the
    block; then laid out, written to ``path`` and closed (files only: never a window)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*grid, **options)
    yield fig, axes
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
