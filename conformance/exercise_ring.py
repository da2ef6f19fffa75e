"""Grading a ring reduce-scatter written by hand (tutorial 10) on inputs that say what is wrong.

``grade(ring)`` runs ``ring(chunks, group)`` on 2 and 3 ranks and on two groups of 2 inside 4
ranks (where a group's ranks are not the global ranks), and returns what is wrong, in words,
or nothing. Every rank's input is *marked*: rank r's row j holds 4 ** (r * S + j) in every
value (S ranks in the group), so a sum of rows is a number whose base-4 digits say which rows
went into it and how many times (a digit up to 3 has no carry; float64 holds such sums exactly
up to S = 5). So a wrong block reads as "rank 1 returned block 2's sum", a missed addition as
"block 0 is missing rank 1's row", and not as a tensor's largest difference.

A ring that deadlocks (every rank sending first with a blocking ``dist.send``, or receiving
from a rank that sends elsewhere) is stopped by the watchdog after ``HANG_SECONDS`` without
progress, and named with the line each rank was stuck on. An exception inside the ring is
reported with its rank and message.

A teacher grades a class in one command: ``python -m twinshard.conformance.exercise_ring
FOLDER`` imports every ``*.py`` of ``FOLDER`` (one student's each), grades its
``ring_reduce_scatter`` and prints one row per student; it exits 1 when any is wrong.
"""

from __future__ import annotations

import linecache
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from twinshard.ranks.launch import launch
from twinshard.ranks.supervise import HangError, LaunchError

N = 3  # values per row
HANG_SECONDS = 20  # no progress for this long: a deadlock
WORLDS = (2, 3)
SUBGROUPS = ([0, 2], [1, 3])  # inside 4 ranks: group rank 1 is global rank 2 or 3


def marked(rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s input (S, N): row j is 4 ** (rank * S + j), every value."""
    powers = torch.tensor([4.0 ** (rank * size + j) for j in range(size)], dtype=torch.float64)
    return powers[:, None].expand(size, N).clone()


def digits(value: float, size: int) -> dict[tuple[int, int], int] | None:
    """{(rank, row): how many times it was added} for a sum of marked rows, or None where
    ``value`` is no such sum (negative, fractional, too large)."""
    if not (value >= 0 and value == int(value) and value < 4.0 ** (size * size)):
        return None
    count, out = int(value), {}
    for k in range(size * size):
        if count % 4:
            out[(k // size, k % size)] = count % 4
        count //= 4
    return out


def diagnose(result, me: int, size: int, who: str = "") -> list[str]:
    """What is wrong with ``result``, group rank ``me``'s return value, in words (``who``
    names the rank, by default "rank ME")."""
    who = who or f"rank {me}"
    if not isinstance(result, torch.Tensor):
        return [f"{who} returned {type(result).__name__}, not a tensor"]
    if tuple(result.shape) != (N,):
        return [
            f"{who} returned shape {tuple(result.shape)}: the reduce-scatter returns this "
            f"rank's block alone, shape ({N},) here (one row of the ({size}, {N}) input)"
        ]
    values = result.detach().to(torch.float64)
    if not torch.equal(values, values[:1].expand(N)):
        return [f"{who}'s block mixes values of different rows: {values.tolist()}"]
    found = digits(values[0].item(), size)
    if found is None:
        return [f"{who}'s block {values[0].item()!r} is no sum of the ranks' rows"]
    blocks = {j for _, j in found}
    if len(blocks) == 1 and blocks != {me} and all(n == 1 for n in found.values()):
        (b,) = blocks
        what = "sum" if len(found) == size else "partial sum"
        return [f"{who} returned block {b}'s {what}, not block {me}'s"]
    problems = []
    missing = [r for r in range(size) if (r, me) not in found]
    if missing:
        problems.append(f"block {me} is missing the rows of rank(s) {missing}")
    twice = {r: n for (r, j), n in found.items() if j == me and n > 1}
    for r, n in twice.items():
        problems.append(f"block {me} has rank {r}'s row {n} times")
    foreign = sorted((r, j) for r, j in found if j != me)
    if foreign:
        said = ", ".join(f"rank {r}'s row of block {j}" for r, j in foreign)
        problems.append(f"block {me} ({who}'s) also holds {said}")
    return problems


def _run(ring, subgroups, folder: str) -> list[str]:
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
    chunks = marked(me, size)
    try:
        result = ring(chunks.clone(), group)
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
    return [problem + where for problem in diagnose(result, me, size, who)]


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


def grade(ring) -> list[str]:
    """What is wrong with ``ring`` (module docstring); an empty list where nothing is."""
    runs = [(size, None) for size in WORLDS] + [(4, SUBGROUPS)]
    for size, subgroups in runs:
        folder = tempfile.mkdtemp(prefix="twinshard-ring-")
        try:
            found = launch(
                _run, size, ring, subgroups, folder, timeout=120, hang_timeout=HANG_SECONDS,
                start_method="fork",
            )  # fmt: skip
        except HangError as error:
            raised = [p.read_text() for p in sorted(Path(folder).glob("rank*.txt"))]
            lines = stuck_lines(error, ring.__name__) or [error.headline]
            return [*raised, f"deadlock at {size} ranks, no progress for {HANG_SECONDS} s:", *lines]
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
    """(file name, what is wrong) for every ``*.py`` of ``folder``, by name; a file that does
    not import, or has no ``ring_reduce_scatter``, is said so."""
    import importlib.util

    out = []
    for path in sorted(Path(folder).glob("*.py")):
        try:
            spec = importlib.util.spec_from_file_location(f"student_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            ring = module.ring_reduce_scatter
        except Exception as error:  # noqa: BLE001 - the submission's, said in its row
            out.append((path.name, [f"does not load: {type(error).__name__}: {error}"]))
            continue
        out.append((path.name, grade(ring)))
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
