"""The reference's parameter group with one planted bug, drawn at random: tutorial 13's mystery.

Each bug of ``BUGS`` is one line of one of the reference's four hooks (``ParamGroup``'s
``unshard_param``, ``reshard``, ``reduce_param``, ``post_backward``) written the way a mistake
writes it, the comment beside it left as it was. ``bug_for(seed)`` draws one; ``hooks_source
(bug)`` is the four hooks' source with that line changed, and ``group_with(bug)`` the group
class made from it, with the reference's names around it. Importing this module as an
implementation (``twinshard conform twinshard.conformance.planted.group_bugs``) shards with the
bug that ``TWINSHARD_MYSTERY`` (a seed, or a bug's name) draws, so every rank draws the same.

The suite catches each at 2 ranks or on a 2x2 mesh (``tests/docs/test_exercise_bug.py``).
"""

from __future__ import annotations

import inspect
import os
import random
import textwrap
from typing import NamedTuple

from twinshard.conformance.exercise_group import fully_shard_with
from twinshard.reference import param_group
from twinshard.reference.param_group import ParamGroup

HOOKS = ("unshard_param", "reshard", "reduce_param", "post_backward")
MYSTERY_ENV = "TWINSHARD_MYSTERY"


class Bug(NamedTuple):
    name: str
    hook: str  # the hook it is planted in
    line: str  # the reference's line, as its source has it
    planted: str  # what the line becomes
    what: str  # the mistake, in words (the answer key: not shown to the student)


BUGS = (
    Bug(
        "gathers_kept_params",
        "unshard_param",
        "if p.state is ParamState.UNSHARDED:",
        "if p.state is ParamState.SHARDED_POST_FORWARD:",
        "gathers a parameter kept unsharded from forward again",
    ),
    Bug(
        "replicas_summed_over_shards",
        "reduce_param",
        "all_reduce_sum(block, p.info.replicate_group, p.fqn)",
        "all_reduce_sum(block, p.info.shard_group, p.fqn)",
        "sums across the shard group a second time instead of across the replicas",
    ),
    Bug(
        "partial_sums_ignored",
        "reduce_param",
        "block = p.combine_partial_sum(block, self.all_reduce_grads)",
        "block = p.combine_partial_sum(block, True)",
        "all-reduces across the replicas although set_requires_all_reduce is off",
    ),
    Bug(
        "mean_over_shards",
        "reduce_param",
        "p.accumulate_grad(block / after)",
        "p.accumulate_grad(block / p.info.shard_size)",
        "divides by the shard group's ranks only, not by every rank (HSDP)",
    ),
    Bug(
        "sync_flags_swapped",
        "post_backward",
        "if self.reduce_grads:",
        "if self.reshard_after_backward:",
        "reduces whenever it reshards, although gradient sync is off",
    ),
)
BY_NAME = {bug.name: bug for bug in BUGS}


def bug_for(seed: str | int) -> Bug:
    """The bug ``seed`` draws (a bug's name draws that bug)."""
    if str(seed) in BY_NAME:
        return BY_NAME[str(seed)]
    return random.Random(str(seed)).choice(BUGS)


def hooks_source(bug: Bug) -> str:
    """The four hooks of the reference's ``ParamGroup``, with ``bug``'s line planted."""
    source = "\n".join(textwrap.dedent(inspect.getsource(getattr(ParamGroup, h))) for h in HOOKS)
    if source.count(bug.line) != 1:
        raise RuntimeError(
            f"group_bugs: the line of bug {bug.name!r} ({bug.line!r}) is not once in the "
            "reference's hooks any more; write the bug again for their new text"
        )
    return source.replace(bug.line, bug.planted)


def group_with(bug: Bug) -> type:
    """A ``ParamGroup`` subclass whose four hooks are ``hooks_source(bug)``."""
    namespace = dict(vars(param_group))  # the names the reference's hooks use
    body = textwrap.indent(hooks_source(bug), "    ")
    exec(f"class Mystery(ParamGroup):\n{body}", namespace)  # noqa: S102 - our own source
    return namespace["Mystery"]


def judge(seed: str | int, found: str, fixed: type, rows: list[dict]) -> list[str]:
    """What is wrong with a student's answer for ``seed``: ``found``, the hook they name, and
    ``fixed``, their subclass of the mystery group, whose suite rows are ``rows``. An empty list
    when the hook is the bug's and the suite passes; the bug itself is never said."""
    from twinshard.conformance.exercise_group import explain

    bug = bug_for(seed)
    if found not in HOOKS:
        return [f"FOUND is {found!r}: name one of the four hooks, {', '.join(HOOKS)}"]
    problems = []
    if found != bug.hook:
        problems.append(f"the planted line is not in {found}: read the report again")
    if found not in vars(fixed):
        problems.append(f"{fixed.__name__} does not define {found}: write the hook, fixed")
    if not rows:
        problems.append("the suite did not run on the fixed group")
    return problems + explain(rows)


Mystery = group_with(bug_for(os.environ.get(MYSTERY_ENV, "0")))
fully_shard = fully_shard_with(Mystery)


def __getattr__(name: str):
    """The rest of the implementation interface: the reference's."""
    from twinshard import reference

    if name in reference.__all__:
        return getattr(reference, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
