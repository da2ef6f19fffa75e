"""The ring exercises' grading by hand (``conformance/exercise_ring.py``), tutorial 10's
reduce-scatter and tutorial 11's all-gather: each answer passes, and each wrong answer of
``support/wrong_rings.py`` and ``support/wrong_gathers.py`` is failed with words that name its
mistake; the deadlocking ones within the watchdog's time, with the line each rank was stuck on."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import wrong_gathers
import wrong_rings

from twinshard.conformance.exercise_ring import HANG_SECONDS, grade

ANSWERS = Path(__file__).parents[2] / "tutorials" / "answers"
ANSWER = ANSWERS / "10_exercise_reduce_scatter.py"
EXERCISES = {  # the function a student writes -> (its answer, its wrong answers)
    "ring_reduce_scatter": (ANSWER, wrong_rings.WRONG),
    "ring_all_gather": (ANSWERS / "11_exercise_all_gather.py", wrong_gathers.WRONG),
}
SHORT_HANG = 3  # seconds
WRONG = [(name, ring) for name, (_, wrong) in EXERCISES.items() for ring in wrong]


def _answer(exercise: str):
    spec = importlib.util.spec_from_file_location("ring_answer", EXERCISES[exercise][0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, exercise)


@pytest.mark.parametrize("exercise", list(EXERCISES))
def test_the_answer_passes(exercise):
    assert grade(_answer(exercise), exercise) == []


@pytest.mark.parametrize(
    "exercise,ring", WRONG, ids=[f"{e.split('_', 1)[1]}-{r.__name__}" for e, r in WRONG]
)
def test_each_wrong_ring_is_named(exercise, ring):
    # A deadlock is named after HANG_SECONDS without progress, as a student meets it, in the
    # reduce-scatter; the all-gather's waits SHORT_HANG, which names it the same way sooner.
    hang = HANG_SECONDS if exercise == "ring_reduce_scatter" else SHORT_HANG
    started = time.monotonic()
    said = grade(ring, exercise, hang_seconds=hang)
    assert said, f"{ring.__name__} passed"
    assert any(EXERCISES[exercise][1][ring] in line for line in said), said
    if ring.__name__ == "blocking_send_first":
        assert time.monotonic() - started < hang + 40
        assert any(f"no progress for {hang:g} s" in line for line in said), said
        assert any(f"of {ring.__name__}: dist.send" in line for line in said), said


def test_a_class_is_graded_in_one_command(tmp_path):
    """A folder of submissions in, one row per student out, exit 1 when any is wrong."""
    import subprocess
    import sys

    answer = ANSWER.read_text(encoding="utf-8")
    (tmp_path / "ada.py").write_text(answer)
    (tmp_path / "bob.py").write_text(
        answer.replace("(me - step - 2) % size]", "(me - step - 1) % size]")
    )
    (tmp_path / "cy.py").write_text("def ring_reduce_scatter(chunks, group)\n")  # no colon
    (tmp_path / "dee.py").write_text(EXERCISES["ring_all_gather"][0].read_text(encoding="utf-8"))
    command = [sys.executable, "-m", "twinshard.conformance.exercise_ring", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    rows = done.stdout.splitlines()
    assert done.returncode == 1, done.stdout + done.stderr
    assert any(r.startswith("ada.py") and r.endswith("right") for r in rows), rows
    assert any(r.startswith("bob.py") and "block 0 is missing" in r for r in rows), rows
    assert any(r.startswith("cy.py") and "does not load: SyntaxError" in r for r in rows), rows
    assert any(r.startswith("dee.py ring_all_gather") and r.endswith("right") for r in rows), rows
    assert rows[-1] == "2 of 4 right", rows
