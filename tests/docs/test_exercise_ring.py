"""Tutorial 10's grading by hand (``conformance/exercise_ring.py``): the answer passes, and each
wrong answer of ``support/wrong_rings.py`` is failed with words that name its mistake; the
deadlocking one within the watchdog's time, with the line each rank was stuck on."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
from wrong_rings import WRONG

from twinshard.conformance.exercise_ring import HANG_SECONDS, grade

ANSWER = Path(__file__).parents[2] / "tutorials" / "answers" / "10_exercise_reduce_scatter.py"


def _answer():
    spec = importlib.util.spec_from_file_location("ring_answer", ANSWER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ring_reduce_scatter


def test_the_answer_passes():
    assert grade(_answer()) == []


@pytest.mark.parametrize("ring", list(WRONG), ids=lambda f: f.__name__)
def test_each_wrong_ring_is_named(ring):
    started = time.monotonic()
    said = grade(ring)
    assert said, f"{ring.__name__} passed"
    assert any(WRONG[ring] in line for line in said), said
    if ring.__name__ == "blocking_send_first":
        assert time.monotonic() - started < HANG_SECONDS + 40
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
    command = [sys.executable, "-m", "twinshard.conformance.exercise_ring", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    rows = done.stdout.splitlines()
    assert done.returncode == 1, done.stdout + done.stderr
    assert any(r.startswith("ada.py") and r.endswith("right") for r in rows), rows
    assert any(r.startswith("bob.py") and "block 0 is missing" in r for r in rows), rows
    assert any(r.startswith("cy.py") and "does not load: SyntaxError" in r for r in rows), rows
    assert rows[-1] == "1 of 3 right", rows
