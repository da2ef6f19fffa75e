"""Tutorial 13's mystery (``conformance/planted/group_bugs.py``): every planted bug is a line of
the reference's hooks as they are today, the seed draws each of them, the suite catches each
at 2 ranks or on a 2x2 mesh with an explanation that points at it, and ``judge`` refuses the
wrong hook without saying the right one. Every bug of a mesh runs in one process group."""

from __future__ import annotations

import math

import pytest

from twinshard.conformance.exercise_group import as_module, explain
from twinshard.conformance.planted.group_bugs import (
    BUGS,
    HOOKS,
    bug_for,
    group_with,
    hooks_source,
    judge,
)
from twinshard.conformance.runner import run_cases
from twinshard.ranks.launch import launch

# bug -> (mesh, the case that must fail, words the explanation must hold)
CAUGHT = {
    "gathers_kept_params": ("2", "reshard_false", "was gathered again"),
    "replicas_summed_over_shards": ("2x2", "per_block", "what is communicated is right"),
    "partial_sums_ignored": ("2x2", "cost_no_all_reduce", "backward, all_reduce"),
    "mean_over_shards": ("2x2", "per_block", "the mean over every rank"),
    "sync_flags_swapped": ("2", "cost_no_sync", "backward, reduce_scatter"),
}


def _run(mesh_shape, jobs, tmpdir):
    """On each rank: each bug of ``jobs`` (name -> case) as a module, through its case."""
    by_name = {bug.name: bug for bug in BUGS}
    return {
        name: run_cases(
            as_module(group_with(by_name[name]), f"mystery_{name}"),
            mesh_shape,
            tmpdir,
            [case],
            False,
        )
        for name, case in jobs.items()
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp, found = str(tmp_path_factory.mktemp("bugs")), {}
    for mesh, shape in (("2", (2,)), ("2x2", (2, 2))):
        jobs = {name: case for name, (m, case, _) in CAUGHT.items() if m == mesh}
        found.update(launch(_run, math.prod(shape), shape, jobs, tmp, timeout=600)[0])
    return found


def test_every_bug_is_planted_in_todays_hooks_and_drawn_by_some_seed():
    assert set(CAUGHT) == {bug.name for bug in BUGS}
    for bug in BUGS:
        assert bug.hook in HOOKS and bug.planted in hooks_source(bug), bug.name
    drawn = {bug_for(seed).name for seed in range(200)}
    assert drawn == set(CAUGHT), drawn
    assert (
        bug_for("2026") == bug_for("2026")
        and bug_for("mean_over_shards").name == "mean_over_shards"
    )


@pytest.mark.parametrize("name", list(CAUGHT))
def test_each_bug_is_caught_and_explained(results, name):
    mesh, case, words = CAUGHT[name]
    said = explain(results[name])
    assert said and said[0].startswith(f"{case} at {mesh}") and words in said[0], said


def test_judge_refuses_the_wrong_hook_without_naming_the_right_one():
    bug = bug_for("2026")
    other = next(h for h in HOOKS if h != bug.hook)
    fixed = type("Fixed", (group_with(bug),), {other: lambda self, *args: None})
    said = judge("2026", other, fixed, [{"case": "per_block", "mesh": "2", "status": "PASS"}])
    assert said == [f"the planted line is not in {other}: read the report again"]
    assert not any(bug.hook in line or bug.planted in line for line in said)
    assert judge("2026", "forward", fixed, [])[0].startswith("FOUND is 'forward'")
