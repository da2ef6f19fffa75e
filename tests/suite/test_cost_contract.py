"""The cost contract (``conformance/contract*.py``, the ``cost_*`` cases): what a setting lets an
implementation communicate and keep alive.

The plans are checked directly (no ranks): which group gathers where, and when gradients are
reduced. Then every planted bug that only costs (the values stay right) is run through the
cases that must catch it, and each catch is asserted with the kind of failure it must give:
all of them in one process group per mesh (2 ranks, and 2x2 for the HSDP one), against the
plain model only. torch's ``fully_shard`` and the reference run the cost cases on the HSDP
meshes that ``tests/suite/test_torch_conformance.py`` and ``tests/suite/test_parity.py`` do not (2x2, 2x1,
1x2; torch with its expected failures), in one process group per mesh.
"""

import math
import re

import pytest
import torch

from twinshard.conformance.contract import GroupSpec, Plan, expected, post_forward_ranks
from twinshard.conformance.runner import run_cases
from twinshard.conformance.suite import (
    apply_xfail,
    default_xfail,
    load_xfail,
    parse_meshes,
)
from twinshard.ranks.launch import launch


def _groups(**settings) -> list[GroupSpec]:
    shapes = {"": [torch.Size([4, 8])], "a": [torch.Size([5, 8])], "b": [torch.Size([3])]}
    return [
        GroupSpec(p, s, [torch.float32] * len(s), **settings.get(p or "root", {}))
        for p, s in shapes.items()
    ]


def test_post_forward_ranks_follow_fully_shard():
    spec = GroupSpec("a", [torch.Size([5])], [torch.float32])
    assert post_forward_ranks(spec, is_root=False, shard=4) == 4  # default: resharded
    assert post_forward_ranks(spec, is_root=True, shard=4) is None  # the root is kept
    spec.reshard_after_forward = 2
    assert post_forward_ranks(spec, is_root=False, shard=4) == 2  # a 1/2 piece
    spec.reshard_after_forward = 4
    assert post_forward_ranks(spec, is_root=False, shard=4) == 4  # the shard size: True
    spec.reshard_after_forward = 1
    assert post_forward_ranks(spec, is_root=False, shard=4) is None  # 1: False
    assert GroupSpec("a", [torch.Size([5, 3]), torch.Size([1])], []).padded(4) == 8 * 3 + 4


def test_plan_of_gradient_accumulation():
    plan = Plan("no sync", _groups(), (2, 2), micro=3)
    plan.sync = lambda path, m: m == 2 or path == "b"
    plan.all_reduce = lambda path, m: m != 2 or path != "a"
    steps = expected(plan)
    assert [s["a"].reduce for s in steps] == [False, False, True]
    assert [s["a"].carries_grads for s in steps] == [False, True, True]
    assert [s["a"].all_reduce for s in steps] == [False, False, False]
    assert steps[2]["a"].partial_sums is False and steps[2][""].all_reduce
    assert [s["b"].all_reduce for s in steps] == [True, True, True]
    assert [s["b"].partial_sums for s in steps] == [False, False, False]


def test_plan_of_kept_and_resharded_groups():
    plan = Plan("kept", _groups(a={"reshard_after_forward": False}), (4,), micro=2)
    plan.reshard_after_backward = lambda path, m: m == 1
    first, second = expected(plan)
    assert first[""].gather_backward is None and first["a"].gather_backward is None
    assert first["b"].gather_backward == 4 and first["b"].after_forward == "sharded"
    assert first["a"].ends_unsharded and second["a"].starts_unsharded
    assert second["a"].gather_forward is None and not second["a"].ends_unsharded
    plan = Plan("int", _groups(b={"reshard_after_forward": 2, "unshard_in_backward": False}), (4,))
    (only,) = expected(plan)
    assert only["b"].after_forward == "piece" and only["b"].gather_backward is None


# Each planted bug that only costs, per mesh: the cases that must catch it and a phrase one of
# the case's failures must contain (what the contract saw).
PLANTED = {
    "2": {
        "syncs_every_micro_batch": {"cost_no_sync": "reduce_scatter: 23 collective(s)"},
        "optimized_syncs_every_micro_batch": {"cost_no_sync": "reduce_scatter: 5 collective(s)"},
        "gathers_fp32": {"cost_bf16": "in float32 over 2 ranks; the contract asks for"},
        "gathers_in_backward": {"cost_unshard_in_backward": "tok all-gathered 570 elements"},
        "reshards_kept": {"cost_reshard_false": "the setting keeps it unsharded here"},
        "optimized_prefetch_all": {"cost_default": "bytes of unsharded parameters"},
        "keeps_grad_buffers": {"cost_default": "bytes of unsharded gradients"},
        "reshards_after_backward": {"cost_last_backward": "the setting keeps it unsharded here"},
        "keeps_after_forward": {"cost_default": "is unsharded; it must be freed"},
        "reduces_fp32": {
            "cost_bf16_reduce": "reduce_scatter: 23 collective(s), 4410 elements in float32"
        },
        "in_pieces_gathered_early": {
            "cost_root_embedding": "all-gather of norm+head was issued in pre_forward of root"
        },
    },
    "2x2": {"all_reduces_every_micro_batch": {"cost_no_all_reduce": "all_reduce: 23"}},
}
# Implementations that must pass every cost case (with their expected failures) on meshes
# that the other runs leave out, and implementations that no other run checks.
PASSING = {
    "2": ["twinshard.optimized.in_pieces"],  # the root in pieces: run by no other test's cases
    "2x2": ["torch.distributed.fsdp"],
    "2x1": ["torch.distributed.fsdp", "twinshard.reference"],
    "1x2": ["torch.distributed.fsdp", "twinshard.reference"],
}
PLANTED_MODULE = "twinshard.conformance.planted."


def _run(mesh_shape, jobs, tmpdir):
    """On each rank: every implementation of ``jobs`` through its cases, one after another."""
    return {impl: run_cases(impl, mesh_shape, tmpdir, cases, False) for impl, cases in jobs.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One process group per mesh, all its implementations in it: impl -> mesh -> rows."""
    tmp = str(tmp_path_factory.mktemp("cost"))
    found: dict = {}
    for mesh in dict.fromkeys([*PLANTED, *PASSING]):
        jobs = {PLANTED_MODULE + bug: list(c) for bug, c in PLANTED.get(mesh, {}).items()}
        jobs.update({impl: ["cost_*"] for impl in PASSING.get(mesh, [])})
        (shape,) = parse_meshes(mesh)
        for impl, rows in launch(_run, math.prod(shape), shape, jobs, tmp, timeout=600)[0].items():
            found.setdefault(impl, {})[mesh] = rows
    return found


@pytest.mark.parametrize("bug", [b for bugs in PLANTED.values() for b in bugs])
def test_planted_cost_is_caught(results, bug):
    mesh, wanted = next((m, bugs[bug]) for m, bugs in PLANTED.items() if bug in bugs)
    rows = {r["case"]: r for r in results[PLANTED_MODULE + bug][mesh]}
    for case, phrase in wanted.items():
        row = rows[case]
        assert row["status"] == "FAIL" and row["failures"], (bug, case, row)
        assert any(phrase in f for f in row["failures"]), (bug, case, row["failures"][:3])
        assert not any("Traceback" in f for f in row["failures"]), row["failures"][0][-2000:]


@pytest.mark.parametrize(
    "impl,mesh", [(impl, mesh) for mesh, impls in PASSING.items() for impl in impls]
)
def test_cost_cases_pass(results, impl, mesh):
    rows = apply_xfail(results[impl][mesh], load_xfail(default_xfail(impl)))
    bad = [(r["case"], r["failures"][:2]) for r in rows if r["status"] in ("FAIL", "XPASS")]
    assert not bad, bad
    assert all(r["reason"] for r in rows if r["status"] in ("XFAIL", "SKIP"))
    statuses = [r["status"] for r in rows]  # torch at 1x2: each an expected failure, with reason
    assert statuses.count("PASS") >= 10 or set(statuses) <= {"XFAIL", "SKIP"}, statuses


def test_the_root_in_pieces_is_held_to_the_contract_piece_by_piece(results):
    """``cost_root_embedding`` under ``in_pieces``: the root's ``norm+head`` piece and the
    first block's last layer are gathered and reduced on their own (the root's piece, kept
    from forward to backward, one all-gather more than the contract asks of one root group,
    the block's two, in forward and backward; one reduce-scatter more each), and the contract,
    holding each as a group of the settings of the call it was cut from, passes them."""
    from twinshard.conformance.cases import cost
    from twinshard.conformance.contract import group_specs
    from twinshard.conformance.contract_check import due_collectives

    rows = results["twinshard.optimized.in_pieces"]["2"]
    (row,) = [r for r in rows if r["case"] == "cost_root_embedding"]
    assert row["status"] == "PASS", row["failures"][:2]
    (note,) = [n for n in row["notes"] if n.startswith("in_pieces: ")]
    ours = [int(n) for n in re.findall(r"(AG|RS|AR) (\d+)", note) for n in n[1:]]
    whole = Plan("whole", group_specs(cost.build(), cost.PATHS[1:]), (2,))
    due = due_collectives(whole, expected(whole)[0])
    asked = [len([d for d in due if d.op == op]) for op in ("all_gather", "reduce_scatter")]
    assert ours == [asked[0] + 3, asked[1] + 2, 0], (note, asked)
