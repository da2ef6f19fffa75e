"""Grading a parameter group written by hand (tutorial 12): the four hooks of one group against
the contract, held to the suite, with each failure said as the class of mistake it shows.

The student writes a ``ParamGroup`` subclass (``twinshard.reference.param_group``) with its own
``unshard_param``, ``reshard``, ``reduce_param`` and ``post_backward``, each using only the
contract's ``ShardedParam`` methods and the reference's three blocking collectives.
``fully_shard_with(group_type)`` makes the ``fully_shard`` of an implementation that is the
reference with that group, so ``twinshard conform`` can check it like any other.

``CASES`` are the cases it is graded on, each with what it checks in words; ``explain(rows)``
turns the suite's rows (``twinshard conform --report``) into one line per failing case that
names the mistake's class ("the mean: gradients", "reduced although gradient sync is off") with
the case's first failure under it. ``as_module(group_type, name)`` registers such an
implementation under a module name inside a rank, for the tests' wrong groups.
"""

from __future__ import annotations

import inspect
import re
import sys
import types

import twinshard.reference as reference
from twinshard.reference.fully_shard import Implementation, shard_module
from twinshard.reference.more.fsdp_module import FSDPModule
from twinshard.reference.state import FSDPState

# case -> what a failure there says about the group, in words
CASES = {
    "per_block": "the values of a plain step: the all-gathered weights, the reduce-scatter and "
    "the mean of the gradients (unshard_param, reduce_param)",
    "reshard_false": "reshard_after_forward=False: weights kept from forward to backward, "
    "gathered once (unshard_param must not gather an unsharded parameter again)",
    "reshard_int": "reshard_after_forward=2: a 1/2 piece kept after forward (reshard's "
    "after_forward, which keeps post_forward_info's piece)",
    "no_sync_all": "gradient accumulation: no reduction while set_requires_gradient_sync is "
    "off, the local sum reduced later (post_backward's reduce_grads)",
    "no_all_reduce": "HSDP partial sums: set_requires_all_reduce(False) keeps the shard "
    "group's sum for later (reduce_param's combine_partial_sum)",
    "bf16_reduce_fp32": "mixed precision: weights gathered in param_dtype, gradients reduced "
    "in reduce_dtype (the dtype each hook is given)",
    "cost_default": "what a default step communicates and keeps alive: each group gathered in "
    "forward and again in backward, its gradients reduced once, weights freed after each",
    "cost_reshard_false": "what reshard_after_forward=False communicates: one all-gather per "
    "group, in forward",
    "cost_no_sync": "what gradient accumulation communicates: no reduce-scatter while "
    "gradient sync is off",
    "cost_no_all_reduce": "what HSDP partial sums communicate: no all-reduce across replicas "
    "while set_requires_all_reduce is off",
    "trace_default": "one blocking collective per parameter, the same on every rank",
}
MESHES = "2,2x2"  # uneven rows are padded at 2 too (the MLP's 15 and 37); 2x2 adds HSDP


def fully_shard_with(group_type: type):
    """``fully_shard`` of the reference with ``group_type`` for its ``ParamGroup``: the same
    arguments, checked and defaulted by the reference's own signature."""
    signature = inspect.signature(reference.fully_shard)

    def fully_shard(*args, **kwargs):
        options = signature.bind(*args, **kwargs)
        options.apply_defaults()
        module = options.arguments.pop("module")
        impl = Implementation(group_type, FSDPState, FSDPModule)
        return shard_module(module, impl, **options.arguments)

    fully_shard.__signature__ = signature
    fully_shard.__doc__ = f"twinshard.reference's fully_shard with {group_type.__name__}."
    return fully_shard


def as_module(group_type: type, name: str) -> str:
    """Register, in this process, an implementation module ``name``: the reference's interface
    with ``fully_shard_with(group_type)``. Returns ``name``, for ``run_cases``."""
    module = types.ModuleType(name, f"twinshard.reference with {group_type.__name__}")
    for attr in reference.__all__:
        setattr(module, attr, getattr(reference, attr))
    module.fully_shard = fully_shard_with(group_type)
    sys.modules[name] = module
    return name


# words in a failure -> the mistake they show, said beside it
HINTS = {
    "replaced by a Parameter": "a parameter already unsharded was gathered again: unshard_param "
    "returns at once when p.state is ParamState.UNSHARDED (after finish_unshard the module holds "
    "the unsharded parameter, not the sharded DTensor)",
    "missing value (expected a tensor)": "a sharded parameter has no gradient after backward: "
    "post_backward must take every gradient (p.take_grad), put the sharded parameters back "
    "(reshard, when reshard_after_backward) and reduce (reduce_param ends with "
    "p.accumulate_grad)",
}
VALUES_ONLY = (
    "what is communicated is right (no cost or trace case fails), the values are not: look at "
    "reduce_param's arithmetic (the mean over every rank, the reduce dtype, the replicas' sum)"
)


def _detail(row: dict) -> str:
    """A row's first failure, an exception as its last line."""
    first = (row.get("failures") or ["(no detail)"])[0]
    if "Traceback" in first:
        lines = [ln.strip() for ln in first.strip().splitlines() if ln.strip()]
        first = f"raised {lines[-1]}"
    return first


def explain(rows: list[dict]) -> list[str]:
    """What the failing rows of ``rows`` say about the group, in words: cost and trace failures
    first (they name the hook and the collective), one line each with the case's first
    failure; then the value failures, grouped by the mistake they show. Empty when none
    failed."""
    failing = [r for r in rows if r["status"] in ("FAIL", "ERROR")]
    counted = [r for r in failing if r["case"].startswith(("cost_", "trace_"))]
    groups: dict[str, list[dict]] = {}  # the mistake's words -> its rows
    for row in counted + [r for r in failing if r not in counted]:
        text = "\n".join(row.get("failures") or [])
        hint = next((h for key, h in HINTS.items() if key in text), None)
        found = re.search(r"(forward|backward), (\w+): (none|\d+ collective)", text)
        said = " ".join(found.groups()) if found else row["case"]  # the same miss, said once
        key = hint or (said if row in counted else VALUES_ONLY)
        groups.setdefault(key, []).append(row)
    out = []
    for key, group in groups.items():
        where = ", ".join(f"{r['case']} at {r['mesh']}" for r in group[:4])
        where += f" and {len(group) - 4} more" if len(group) > 4 else ""
        first = group[0]
        said = key if key in HINTS.values() or key == VALUES_ONLY else CASES[first["case"]]
        if key == VALUES_ONLY and counted:
            said = f"the values too: {CASES.get(first['case'], first['case'])}"
        out.append(f"{where}: {said}\n    {_detail(first)}")
    return out
