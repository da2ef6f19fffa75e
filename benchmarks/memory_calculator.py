"""The data of the site's memory calculator: ``twinshard plan``'s memory over a grid, as JSON.

    python benchmarks/memory_calculator.py               # record the grid, write docs/memory/plans.json
    python benchmarks/memory_calculator.py --check 2     # record 2 settings again: exit 1 if the
                                                         # committed data is not what they give now

The calculator (``docs/memory.md``, drawn by ``docs/js/memory.js``) lets a reader pick a model,
a sequence length, a world size, a precision, activation checkpointing and
``reshard_after_forward``, and shows rank 0's device memory at its peak, part by part, as
``twinshard plan`` reports it, against the devices the planner knows. This script makes what it
shows, and the site serves the file it writes (``docs/hooks/memory.py`` points the page at it):

- ``AXES`` declares the grid, ``grid(axes)`` is every combination of it (a ``Setting`` each),
  and ``Setting.arguments`` the ``twinshard plan`` flags of one; its job is made from those
  flags by the command's own parser (``plan_job``), so the inputs are the command's;
- ``record_setting(setting)`` records one with the planner's own recorder
  (``plan.runner.record_many``, what ``twinshard plan`` runs before it prices the step), in a
  fresh process; ``record_grid`` does every setting, ``WORKERS`` at once; a setting that cannot
  be recorded raises ``RecordingFailed`` naming its command line;
- ``page_data(found, axes)`` turns them into the page's JSON, and refuses a grid with a
  combination missing.

Each setting is recorded at 4 and 5 blocks and continued to the model's depth
(``memory_depth.py``, [Note: the model's depth, extrapolated]), or, where that line is not known
to hold, recorded at the model's depth as ``twinshard plan`` records it. The caching
allocator's reserved bytes do not grow by a constant per block (20.8, 21.5, 23.3 GB at 3, 4, 5
blocks of Llama 3 8B, 48.0 at 32), so the page gives allocated bytes, and the command that
prints the reserved peak.

Why a committed file and not the site's build: the grid takes about forty minutes on a 2-core
machine (a setting of the 70B recorded at its 80 blocks takes minutes), far past what the
build may take in CI. The data says which commit recorded it; ``tests/docs/test_memory_calculator.py``
records one setting again at the small depths in every run and three at full depth in the full
tier, and fails, naming this command, when the planner's memory has moved from the data.
Finished settings are kept in ``build/memory-calculator/`` while the grid runs, so a run that
is stopped goes on where it stopped (``--fresh`` starts over).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import memory_depth  # beside this script

from twinshard.measure import grid as jobs_grid
from twinshard.measure.plan import cli as plan_cli
from twinshard.measure.plan.profiles import DEVICES
from twinshard.measure.plan.table import PART_NAMES
from twinshard.measure.plan.trace import PARTS

# Each axis of the grid: its values, in the order the page offers them.
AXES = {
    "model": ("llama3-8b", "llama3-70b"),
    "seq": (2048, 8192),
    "batch": (1,),  # sequences per rank (--per-rank); 2 would double the grid's time
    "world": (8, 64),
    "dtype": ("bf16", "fp32"),  # bf16: bf16 compute, fp32 master weights and reduction
    "ac": ("none", "selective", "block"),
    "reshard": (True, False),  # reshard_after_forward of the blocks
}
IMPL = "optimized"  # twinshard's fast path
WORKERS = 2  # recording processes at once (one per core here)
ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "memory" / "plans.json"  # what the site serves to the page
KEPT = ROOT / "build" / "memory-calculator"  # finished settings of a run in progress
SOURCES = ("twinshard", "reference", "optimized", "variants")  # the code a recording runs


class RecordingFailed(RuntimeError):
    """A setting of the calculator's grid could not be recorded; the message names it."""


@dataclass(frozen=True)
class Setting:
    """One point of the grid: a ``twinshard plan`` job of ``IMPL``."""

    model: str
    seq: int
    batch: int
    world: int
    dtype: str
    ac: str
    reshard: bool

    @property
    def key(self) -> str:
        """How the page finds it: the values in ``AXES``' order, 'llama3-8b|2048|1|8|...'."""
        return "|".join(str(v).lower() for v in asdict(self).values())

    def arguments(self) -> list[str]:
        """The ``twinshard plan`` flags of this setting."""
        return [
            *("--model", self.model, "--impls", IMPL, "--world", str(self.world)),
            *("--seq", str(self.seq), "--per-rank", str(self.batch), "--dtype", self.dtype),
            *("--ac", self.ac, "--reshard-after-forward", str(self.reshard).lower()),
        ]

    def command(self) -> str:
        return "twinshard plan " + " ".join(self.arguments())


def grid(axes: dict = AXES) -> list[Setting]:
    """Every combination of ``axes`` (``AXES``' keys, each with its values)."""
    return [Setting(**point) for point in jobs_grid.points(axes)]


def plan_job(setting: Setting):
    """The job ``twinshard plan`` makes of ``setting``'s flags, read by the command's own
    parser and checked by it; ``RecordingFailed`` with the command's message if it is wrong."""
    parser = argparse.ArgumentParser(prog="twinshard plan")
    plan_cli.add_arguments(parser)
    points, wrong = plan_cli.configs_from(parser.parse_args(setting.arguments()))
    if wrong:
        raise RecordingFailed(f"the calculator cannot plan `{setting.command()}`: {wrong}")
    return points[0][0]


# --- recording --------------------------------------------------------------------------------
def record_setting(setting: Setting) -> dict:
    """``setting``'s memory at its peak at the model's depth: ``parts`` (the plan's parts,
    bytes), ``peak_bytes``, ``peak_at`` (where the step was), ``params`` and ``blocks`` (the
    whole model's), and ``recorded`` (the depths recorded)."""
    job = plan_job(setting)
    shallow = record(setting, [jobs_grid.at(job, {"n_layers": d}) for d in memory_depth.DEPTHS])
    line = memory_depth.continued(shallow, job.llama().n_layers)
    if line is not None:
        return {**line, "recorded": list(memory_depth.DEPTHS)}
    (whole,) = record(setting, [job])
    model = whole["model"]
    return {
        "parts": whole["parts"],
        "peak_bytes": whole["peak_bytes"],
        "peak_at": whole["peak_label"],
        "params": model["params"],
        "blocks": model["layers"],
        "recorded": [model["layers"]],
    }


def record(setting: Setting, jobs: list) -> list[dict]:
    """``runner.record`` of each of ``setting``'s ``jobs``, in one fresh process;
    ``RecordingFailed`` names the setting if one failed."""
    from twinshard.measure.plan.runner import record_many

    recorded = record_many(jobs, progress=False)
    for done in recorded:
        if "error" in done:
            last = done["error"].strip().splitlines()[-1]
            raise RecordingFailed(f"`{setting.command()}` failed to record: {last}")
    return recorded


def record_grid(settings: list[Setting], kept: Path | None = None) -> dict[Setting, dict]:
    """``record_setting`` of each, ``WORKERS`` at once; with ``kept``, each finished setting
    is written there as it finishes and read back instead of recorded again."""

    def one(setting: Setting) -> dict:
        path = kept / f"{setting.key.replace('|', '_')}.json" if kept else None
        if path and path.is_file():
            return json.loads(path.read_text(encoding="utf-8"))
        started = time.monotonic()
        found = record_setting(setting)
        print(f"{time.monotonic() - started:6.1f} s  {setting.command()}", flush=True)
        if path:
            path.write_text(json.dumps(found), encoding="utf-8")
        return found

    if kept:
        kept.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(WORKERS) as pool:
        return dict(zip(settings, pool.map(one, settings)))


# --- the page's JSON ----------------------------------------------------------------------------
def page_data(found: dict[Setting, dict], axes: dict = AXES) -> dict:
    """What the page reads (see the module docstring); every combination of ``axes`` must be in
    ``found``."""
    missing = [s.command() for s in grid(axes) if s not in found]
    if missing:
        raise ValueError(f"{len(missing)} settings were not recorded, first `{missing[0]}`")
    devices = {n: d for n, d in DEVICES.items() if n != "cpu"}
    return {
        "axes": {name: list(values) for name, values in axes.items()},
        "impl": IMPL,
        "depths": list(memory_depth.DEPTHS),
        "parts": [{"key": p, "name": PART_NAMES[p]} for p in PARTS],
        "devices": [{"key": n, "name": d.name, "bytes": d.capacity} for n, d in devices.items()],
        "settings": {s.key: {**found[s], "command": s.command()} for s in grid(axes) if s in found},
    }


# --- the command --------------------------------------------------------------------------------
def commit() -> str:
    """The last commit that changed the code a recording runs (the engine and the planner),
    with '+changes' if the tree differs from it there."""
    git = ["git", "-C", str(ROOT)]
    code = ["--", *SOURCES]
    last = subprocess.run([*git, "log", "-1", "--format=%h", *code], capture_output=True, text=True)
    dirty = subprocess.run([*git, "status", "--porcelain", *code], capture_output=True, text=True)
    return last.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def write(found: dict[Setting, dict], seconds: float, out: Path) -> None:
    import torch

    data = page_data(found)
    data["made_by"] = {
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "seconds": round(seconds),
        "command": "python benchmarks/memory_calculator.py",
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")  # axes in AXES order


def stale(settings: list[Setting], data: dict) -> list[str]:
    """What differs between ``settings`` recorded now and the committed ``data``, one line
    each; empty when the data is what the planner gives today."""
    wrong = []
    for setting in settings:
        shown = data["settings"].get(setting.key)
        now = {**record_setting(setting), "command": setting.command()}
        for field, value in now.items():
            if shown is None or shown.get(field) != value:
                was = None if shown is None else shown.get(field)
                wrong.append(f"{setting.command()}: {field} is {value}, the data has {was}")
    return wrong


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DATA, help="the JSON to write")
    parser.add_argument("--fresh", action="store_true", help="forget a stopped run's settings")
    parser.add_argument(
        "--check", type=int, metavar="N",
        help="record N settings of the grid again (spread over it) and exit 1 if the data at "
        "--out differs from them; writes nothing",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.check:
        data = json.loads(args.out.read_text(encoding="utf-8"))
        every = grid()
        wrong = stale(every[:: max(1, len(every) // args.check)][: args.check], data)
        print("\n".join(wrong) or f"{args.out}: {args.check} settings recorded again, all equal")
        return 1 if wrong else 0
    if args.fresh:
        shutil.rmtree(KEPT, ignore_errors=True)
    started = time.monotonic()
    found = record_grid(grid(), kept=KEPT)
    write(found, time.monotonic() - started, args.out)
    print(f"wrote {args.out}: {len(found)} settings in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
