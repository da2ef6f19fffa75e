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
