"""Run the conformance suite over several meshes and turn the results into a verdict.

``run_suite`` launches one process group per mesh (world size 2 first: its ``dcp_save`` case
writes the checkpoints that ``dcp_load`` reads at the other sizes) and runs every selected
case inside it. ``apply_xfail`` marks expected failures from an implementation's file, and
``report`` renders the table. The CLI (``twinshard conform``) and the pytest plugin both
use these functions, so they always agree.

Expected-failures file: one entry per line, ``CASE[@MESH]: reason``, where CASE and MESH are
shell patterns (``dcp_*``, ``2x2``); ``#`` starts a comment. An expected failure that passes
is reported as XPASS and fails the run, so the file cannot go stale unnoticed.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import pathlib
import tempfile
from dataclasses import dataclass

from twinshard.optimized.streams import STANDIN_ENV

from .cases import CASES, Context
from .lossy import VARIANT_ENV
from .runner import oracle_names, partial_rows_path, run_cases, select, skip_row

DEFAULT_MESHES = "1,2,3,2x2"
# a lossy variant's meshes: odd shard lengths (3), a shard group of 4 (nodes of 2: qgZ by node,
# hpZ), an HSDP mesh (a sum over the shard group, not the world)
LOSSY_MESHES = "1,2,3,4,2x2"
XFAIL_DIR = pathlib.Path(__file__).with_name("xfail")


def parse_meshes(text: str) -> list[tuple[int, ...]]:
    """'1,2,3,2x2' -> [(2,), (1,), (3,), (2, 2)] (world size 2 first, for the checkpoints)."""
    meshes = []
    for part in text.split(","):
        part = part.strip()
        try:
            shape = tuple(int(n) for n in part.split("x"))
        except ValueError:
            raise ValueError(
                f"bad mesh {part!r}: use a world size (3) or replicas x shards (2x2)"
            ) from None
        if not 1 <= len(shape) <= 2 or min(shape) < 1:
            raise ValueError(f"bad mesh {part!r}: use a world size (3) or replicas x shards (2x2)")
        meshes.append(shape)
    return sorted(meshes, key=lambda s: s != (2,))


def mesh_name(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def applicable(shape: tuple[int, ...], patterns: list[str] | None) -> list[str]:
    """Cases that apply to a mesh (by the case's own condition) among those selected; the
    others are reported as SKIP with their reason."""
    ctx = Context(None, "", None, shape, "")
    return [n for n in select(patterns) if CASES[n].skip_reason(ctx) is None]


def run_suite(
    impl: str,
    meshes: list[tuple[int, ...]],
    patterns: list[str] | None = None,
    device: str = "cpu",
    timeout: float = 600.0,
    tmpdir: str | None = None,
    progress=None,
    stand_in_streams: bool = False,
    oracles=True,
    variant: str | None = None,
) -> list[dict]:
    """Every selected case on every mesh; one row per (mesh, case), SKIP where a case does not
    apply. ``stand_in_streams``: run the accelerator schedule on the CPU, with stream checks
    (``twinshard.dispatch.standin``). ``oracles=False`` compares with the plain model only
    (not with the reference and torch): faster, for a second pass in another mode; a tuple
    of names (``("reference",)``) runs only those oracles. ``variant``: the ``lossy_given``
    case's (``conformance/lossy.py``, ``load_variant``)."""
    import torch

    from twinshard.ranks.launch import LaunchError, launch

    rows = []
    with tempfile.TemporaryDirectory(prefix="twinshard-conform-") as scratch:
        tmp = tmpdir or scratch
        env = {STANDIN_ENV: "1"} if stand_in_streams else {}
        if variant:
            env[VARIANT_ENV] = variant
        for shape in meshes:
            world = math.prod(shape)
            names = select(patterns)
            backend = "nccl" if device == "cuda" else "gloo"
            if device == "cuda" and world > torch.cuda.device_count():
                reason = f"needs {world} GPUs, {torch.cuda.device_count()} present"
                rows += [skip_row(n, shape, reason) for n in names]
                continue
            try:
                rows += launch(
                    run_cases,
                    world,
                    impl,
                    shape,
                    tmp,
                    names,
                    oracle_names(oracles),
                    device,
                    backend=backend,
                    timeout=timeout,
                    env=env,
                )[0]
            except LaunchError as error:  # a crash or a hang: every case of this mesh fails
                rows += stopped_mesh(tmp, shape, names, str(error)[-4000:])
            if progress:
                progress(shape, [r for r in rows if r["mesh"] == mesh_name(shape)])
    return rows


def stopped_mesh(tmp: str, shape: tuple[int, ...], names: list[str], error: str) -> list[dict]:
    """The rows of a mesh whose launch failed: where a rank stopped it after a case failed
    there alone (``runner.abandon``), the cases run until then as they ended and the rest as
    not run; else (a crash, a hang) every case failed with ``error``."""
    path = partial_rows_path(tmp, shape)
    if not os.path.exists(path):
        return [skip_row(n, shape, "", status="FAIL", failures=[error]) for n in names]
    with open(path) as f:
        done = json.load(f)
    os.remove(path)
    stopped = done[-1]["case"]
    why = f"not run: the mesh stopped after case {stopped} failed on some ranks only"
    ran = {row["case"] for row in done}
    return done + [
        skip_row(n, shape, "", status="FAIL", failures=[why]) for n in names if n not in ran
    ]


@dataclass
class Expected:
    case: str
    mesh: str
    reason: str


def load_xfail(path: str | os.PathLike | None) -> list[Expected]:
    if path is None:
        return []
    entries = []
    for number, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        target, sep, reason = line.partition(":")
        if not sep or not reason.strip():
            raise ValueError(f"{path}:{number}: expected 'CASE[@MESH]: reason', got {line!r}")
        case, _, mesh = target.strip().partition("@")
        entries.append(Expected(case.strip(), mesh.strip() or "*", reason.strip()))
    return entries


def default_xfail(impl: str) -> pathlib.Path | None:
    """The expected-failures file shipped for a known implementation, if any."""
    path = XFAIL_DIR / f"{impl}.txt"
    return path if path.is_file() else None


def apply_xfail(rows: list[dict], expected: list[Expected]) -> list[dict]:
    for row in rows:
        match = next(
            (
                e
                for e in expected
                if fnmatch.fnmatch(row["case"], e.case) and fnmatch.fnmatch(row["mesh"], e.mesh)
            ),
            None,
        )
        if match is None or row["status"] == "SKIP":
            continue
        row["reason"] = match.reason
        row["status"] = "XFAIL" if row["status"] == "FAIL" else "XPASS"
    return rows


def failed(rows: list[dict]) -> bool:
    return any(r["status"] in ("FAIL", "XPASS") for r in rows)


def report(rows: list[dict], impl: str, fmt: str = "text") -> str:
    """The verdict as a table (text or markdown) or as JSON."""
    if fmt == "json":
        return json.dumps(
            {"implementation": impl, "passed": not failed(rows), "rows": rows},
            indent=1,
            default=str,
        )
    head = ["case", "mesh", "result", "worst abs", "worst rel", "where", "s"]
    lines = []
    for r in rows:
        detail = r["where"]
        if r["status"] in ("XFAIL", "XPASS", "SKIP"):
            detail = r["reason"]
        elif r["status"] == "FAIL" and r["failures"]:
            detail = r["failures"][0].strip().splitlines()[-1]
        lines.append(
            [
                r["case"],
                r["mesh"],
                r["status"],
                _num(r["max_abs"]),
                _num(r["max_rel"]),
                detail[:110],
                f"{r['seconds']:.1f}",
            ]
        )
    counts = {
        s: sum(r["status"] == s for r in rows) for s in ("PASS", "FAIL", "XFAIL", "XPASS", "SKIP")
    }
    summary = f"{impl}: " + ", ".join(f"{n} {s.lower()}" for s, n in counts.items() if n)
    if fmt == "markdown":
        out = [
            f"# Conformance: `{impl}`",
            "",
            summary,
            "",
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
        ]
        out += ["| " + " | ".join(c.replace("|", "/") for c in line) + " |" for line in lines]
        return "\n".join(out) + "\n"
    widths = [
        max(len(h), *(len(line[i]) for line in lines)) if lines else len(h)
        for i, h in enumerate(head)
    ]
    fmt_line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt_line(head), *(fmt_line(line) for line in lines), "", summary]) + "\n"


def _num(x) -> str:
    return "-" if x is None or x != x else f"{x:.2e}"
