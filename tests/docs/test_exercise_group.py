"""Tutorial 12's grading (``conformance/exercise_group.py``): the answer's group passes every
case it is graded on, on every mesh, and each wrong group of ``support/wrong_groups.py`` fails
the case its mistake shows in, explained in words that name the mistake's class. Every group of
a mesh runs in one process group of that mesh, each registered as a module inside the ranks."""

from __future__ import annotations

import math

import pytest
from wrong_groups import WRONG, MyGroup

from twinshard.conformance.exercise_group import CASES, MESHES, as_module, explain
from twinshard.conformance.runner import run_cases
from twinshard.conformance.suite import parse_meshes
from twinshard.ranks.launch import launch


def _run(mesh_shape, jobs, tmpdir):
    """On each rank: each group of ``jobs`` (class -> cases) as a module, through its cases."""
    return {
        group.__name__: run_cases(
            as_module(group, f"graded_{group.__name__}"), mesh_shape, tmpdir, cases, False
        )
        for group, cases in jobs.items()
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """mesh -> group name -> rows: the answer at 2 ranks with every case, each wrong group on
    its mesh with the case that must catch it."""
    tmp = str(tmp_path_factory.mktemp("groups"))
    found = {}
    for shape in parse_meshes(MESHES):
        mesh = "x".join(map(str, shape))
        jobs = {MyGroup: list(CASES)} if mesh == "2" else {}  # the notebook runs it everywhere
        jobs.update({g: [case] for g, (m, case, _) in WRONG.items() if m == mesh})
        if not jobs:
            continue
        found[mesh] = launch(_run, math.prod(shape), shape, jobs, tmp, timeout=600)[0]
    return found


def test_the_answer_passes(results):
    """At 2 ranks; tutorial 12 runs it at every mesh of ``MESHES`` (CI executes the notebook)."""
    rows = results["2"]["MyGroup"]
    assert explain(rows) == [], explain(rows)
    assert sum(r["status"] == "PASS" for r in rows) >= len(CASES) // 2, rows


@pytest.mark.parametrize("group", list(WRONG), ids=lambda g: g.__name__)
def test_each_wrong_group_is_named(results, group):
    mesh, case, words = WRONG[group]
    said = explain(results[mesh][group.__name__])
    assert said, f"{group.__name__} passed {case} at {mesh}"
    assert said[0].startswith(f"{case} at {mesh}") and words in said[0], said
