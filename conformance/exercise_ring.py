"""Grading a ring collective written by hand (tutorials 10 and 11) on inputs that say what is
wrong.

``grade(ring, exercise)`` runs ``ring`` on 2 and 3 ranks and on two groups of 2 inside 4 ranks
(where a group's ranks are not the global ranks), and returns what is wrong, in words, or
nothing. The exercises are ``ring_marks.py``'s: the ring reduce-scatter
(``"ring_reduce_scatter"``, tutorial 10) and the ring all-gather (``"ring_all_gather"``,
tutorial 11). Every rank's input is *marked* (one power of four per row), so a wrong result
reads as "rank 1 returned block 2's sum" or "row 0 holds rank 1's shard".

A ring that deadlocks (every rank sending first with a blocking ``dist.send``, or receiving
from a rank that sends elsewhere) is stopped by the watchdog after ``HANG_SECONDS`` without
progress, and named with the line each rank was stuck on. An exception inside the ring is
reported with its rank and message.

A teacher grades a class in one command: ``python -m twinshard.conformance.exercise_ring
FOLDER`` imports every ``*.py`` of ``FOLDER`` (one student's each), grades each exercise's
function it defines and prints one row per student and exercise; it exits 1 when any is wrong.
"""

from __future__ import annotations

import linecache
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch.distributed as dist

from twinshard.conformance.ring_marks import EXERCISES
from twinshard.ranks.launch import launch
from twinshard.ranks.supervise import HangError, LaunchError

HANG_SECONDS = 10  # no progress for this long: a deadlock (a right ring takes milliseconds)
WORLDS = (2, 3)
SUBGROUPS = ([0, 2], [1, 3])  # inside 4 ranks: group rank 1 is global rank 2 or 3


def _run(ring, exercise: str, subgroups, folder: str) -> list[str]:
    """On each rank: the ring on its marked rows, in the world or in its subgroup. A rank whose
    ring raises writes its error to ``folder`` and leaves at once, so that the run stops (the
    ranks it would leave waiting stop with it) and the error is read from the file."""
    group = dist.group.WORLD
    if subgroups:
        made = [dist.new_group(ranks) for ranks in subgroups]  # every rank makes every group
        group = next(g for g, ranks in zip(made, subgroups) if dist.get_rank() in ranks)
    size, me = dist.get_world_size(group), dist.get_rank(group)
    ranks = next((r for r in subgroups or () if dist.get_rank() in r), None)
    who = f"rank {me}" if ranks is None else f"rank {me} of group {ranks}"
    kind = EXERCISES[exercise]
    try:
        result = ring(kind.marked(me, size), group)
    except Exception as error:  # noqa: BLE001 - the student's error, said with its rank
        words = re.sub(r"group <torch\.distributed\S* object at 0x\w+>", "its group", str(error))
        said = f"{who} raised {type(error).__name__}: {words}"
        if "not part of" in str(error) or "not in group" in str(error):
            said += (
                " (a group rank used as a global one: dist.isend and dist.recv take global "
                "ranks; dist.get_global_rank(group, i) converts group rank i)"
            )
        Path(folder, f"rank{dist.get_rank()}.txt").write_text(said)
        os._exit(3)  # at once: the ranks it leaves waiting are stopped with the run
    where = f" (groups {list(subgroups)} of 4 ranks)" if subgroups else f" ({size} ranks)"
    return [problem + where for problem in kind.diagnose(result, me, size, who)]


def stuck_lines(error: HangError, name: str) -> list[str]:
    """The line of function ``name`` each rank was stuck on, from the watchdog's stacks."""
    out = []
    for rank, text in sorted(error.failures.items()):
        lines = [ln for ln in text.splitlines() if f"in {name}" in ln]
        if lines:  # faulthandler: 'File "PATH", line N in NAME', innermost first
            path, _, rest = lines[0].strip().partition('", line ')
            number = int(rest.split()[0])
            code = linecache.getline(path.removeprefix('File "'), number).strip()
            out.append(f"global rank {rank} waits at line {number} of {name}: {code or '?'}")
    return out


def grade(ring, exercise: str = "ring_reduce_scatter", hang_seconds: float = HANG_SECONDS):
    """What is wrong with ``ring``, an answer to ``exercise`` (module docstring), as a list of
    lines; an empty list where nothing is. A run without progress for ``hang_seconds`` is a
    deadlock."""
    if exercise not in EXERCISES:
        raise ValueError(f"grade: no exercise {exercise!r}; the exercises are {list(EXERCISES)}")
    runs = [(size, None) for size in WORLDS] + [(4, SUBGROUPS)]
    for size, subgroups in runs:
        folder = tempfile.mkdtemp(prefix="twinshard-ring-")
        try:
            found = launch(
                _run, size, ring, exercise, subgroups, folder, timeout=120, hang_timeout=hang_seconds,
                start_method="fork",
            )  # fmt: skip
        except HangError as error:
            raised = [p.read_text() for p in sorted(Path(folder).glob("rank*.txt"))]
            lines = stuck_lines(error, ring.__name__) or [error.headline]
            return [
                *raised,
                f"deadlock at {size} ranks, no progress for {hang_seconds:g} s:",
                *lines,
            ]
        except LaunchError as error:
            raised = [p.read_text() for p in sorted(Path(folder).glob("rank*.txt"))]
            return raised or [f"the ring failed at {size} ranks: {str(error).splitlines()[0]}"]
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        problems = [p for rank in found for p in rank]
        if problems:
            return problems
    return []


def grade_folder(folder: str) -> list[tuple[str, list[str]]]:
    """("FILE FUNCTION", what is wrong) for each exercise's function of every ``*.py`` of
    ``folder``, by name; a file that does not import, or defines none, is said so."""
    import importlib.util

    out = []
    for path in sorted(Path(folder).glob("*.py")):
        try:
            spec = importlib.util.spec_from_file_location(f"student_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except Exception as error:  # noqa: BLE001 - the submission's, said in its row
            out.append((path.name, [f"does not load: {type(error).__name__}: {error}"]))
            continue
        found = [name for name in EXERCISES if callable(getattr(module, name, None))]
        if not found:
            out.append((path.name, [f"defines none of {', '.join(EXERCISES)}"]))
        out += [(f"{path.name} {name}", grade(getattr(module, name), name)) for name in found]
    return out


def main(argv: list[str] | None = None) -> int:
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print(
            "usage: python -m twinshard.conformance.exercise_ring FOLDER (of students' .py files)"
        )
        return 2
    rows = grade_folder(args[0])
    if not rows:
        print(f"{args[0]}: no .py file to grade")
        return 2
    width = max(len(name) for name, _ in rows)
    for name, problems in rows:
        print(f"{name:<{width}}  {'right' if not problems else problems[0]}")
        for more in problems[1:3]:
            print(f"{'':<{width}}  {more}")
    wrong = sum(1 for _, problems in rows if problems)
    print(f"{len(rows) - wrong} of {len(rows)} right")
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
