"""The conformance suite's runs, each computed once per session and read by every test that
checks it.

A run is an implementation over a list of meshes, each mesh with its ``run_suite`` options
(oracles, stand-in streams, case patterns). ``rows(run, mesh)`` gives the rows of one mesh
once the run's meshes before it have run: the meshes of one run share a scratch folder, and
world size 2 goes first, since its ``dcp_save`` writes the checkpoints that ``dcp_load`` reads
at the other sizes. Each mesh is one task in the session's shared world of that size
(``shared_worlds.py``), so the ranks that checked the reference at a mesh still hold its runs
(and the plain model's, and torch's) when the optimized path is checked there with the
reference and torch as oracles (``conformance/shared_runs.py``): nothing is trained twice.

``RUNS`` names the runs of the whole session; ``test_parity.py``, ``test_torch_conformance.py``
and ``test_conformance.py`` read them. ``TWINSHARD_PARITY_REPORT=PREFIX`` writes each run's
rows to ``PREFIX.<run>.json`` as they come.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import tempfile

import pytest
from coverage_scope import unmeasured

from twinshard.conformance.cases import CASES
from twinshard.conformance.runner import select
from twinshard.conformance.suite import mesh_name, parse_meshes, run_suite

OPTIMIZED = "twinshard.optimized"
TORCH = "torch.distributed.fsdp"
# The cost cases (what is communicated and kept alive) where a neighbouring mesh has nothing
# new to show them: the reference at 3 (the optimized path runs them there) and the stand-in
# streams at 3x1 and 1x3 (as at 2x1 and 1x2).
NOT_COST = [n for n in select(None) if not n.startswith("cost_")]
# The stand-in streams check the order and lifetime of what runs on streams, so of the lossy
# cases they run the first eight, whose custom collectives cover every variant's stream use;
# the rest (precisions, block sizes, shapes, fp8) check what a variant computes, which the
# optimized run checks at every mesh without streams.
STREAM_LOSSY = {"lossy_" + n for n in ("qwz_int8", "qwz_int4", "qgz_int8", "qgz_int4")}
STREAM_LOSSY |= {"lossy_" + n for n in ("bf16_wire", "qwz_qgz", "qgz_by_node", "zeropp_hpz")}
FOR_STREAMS = [n for n in select(None) if not n.startswith("lossy_") or n in STREAM_LOSSY]
# At 2x1 and 1x2 the reductions take their shortcuts (no reduce-scatter over one rank, no
# all-reduce over one replica): the cases that reduce gradients show them on streams; the rest
# (state dicts, the API, errors, traces, costs, variants) see the streams of 2 and 2x2 again.
# Of the training cases, those whose gradients take another way to the reduction (one group,
# per block, a whole model, each reshard setting, frozen and unused parameters); the others
# change the forward (two forwards, dict outputs, ignored parameters, other shard dims) and
# reach the same reductions.
REDUCING_TRAINING = ["one_group", "per_block", "llama", "reshard_false", "reshard_true_root"]
REDUCING_TRAINING += ["reshard_int", "frozen", "unused"]
REDUCING = ("gradients", "mixed_precision", "offload")
SHORTCUTS = [n for n in FOR_STREAMS if CASES[n].group in REDUCING or n in REDUCING_TRAINING]
# At 2x2 the stand-in streams run, in the default tier, the cases that reduce gradients (the
# replicas' all-reduce is on a stream there and nowhere else) and the lossy cases with custom
# collectives over the replicas; the rest gather over the same shard group of 2 as at 2, and
# run there (102 s of CI for every case at 2x2).
AT_2X2 = SHORTCUTS + sorted(STREAM_LOSSY)
# At 3 (odd shard lengths) and 2x2 (HSDP) the default tier runs the cases whose result
# depends on the mesh; these check the interface (its methods, errors, what a user holds of a
# parameter, pickling, compiling), which world size 2 checks, and run there in the full tier.
MESH_FREE = [n for n in select(None) if CASES[n].group in ("api", "errors", "aliasing")]
MESH_FREE += ["torch_fsdp_module", "unshard_before_forward", "list_form", "pickle", "compile"]
MESH_FREE += ["module_list_with_forward", "post_accumulate_grad_hooks", "summon_full_params"]
MESH_FREE += ["fsdp_module_methods", "reset_after_error", "one_rank_no_collectives"]
MESH_BOUND = [n for n in select(None) if n not in MESH_FREE]
# World size 4 in the default tier: the cases that need a shard group of 4 (an int
# reshard_after_forward below the shard size, tensor parallelism, hpZ by node), and two models
# on uneven shards; the rest repeat 2 and 3 there, and run in the full tier.
AT_FOUR = ["per_block", "llama", "trace_reshard_int", "cost_reshard_int", "tensor_parallel"]
AT_FOUR += ["lossy_qgz_by_node", "lossy_zeropp_hpz", "lossy_fp8_hpz", "lossy_shapes_hpz"]

# name -> (implementation, [(meshes, run_suite options)]); world size 2 first in each run.
# ``FULL`` in the options: only in the full tier (``--full``); each such part says why it only
# repeats a check the default tier makes. ``FULL_ORACLES``: the part's oracles in the full
# tier, where they train anyway (the reference's runs at 3 and 2x2), instead of ``oracles``.
FULL = "full"
FULL_ORACLES = "full_oracles"
FULL_TIER = False  # set by conftest.py: whether this session runs the full tier
RUNS = {
    "reference": (
        "twinshard.reference",
        [
            ("2,1", {"oracles": False}),
            # The reference again at 3 and 2x2: the optimized path is checked there case by
            # case, with the reference as its oracle, so the reference trains every training
            # case there in the default tier too (compared with the optimized path).
            ("3", {"oracles": False, "patterns": NOT_COST, FULL: 1}),
            ("2x2", {"oracles": False, FULL: 1}),
        ],
    ),
    "optimized": (
        OPTIMIZED,
        [
            ("2", {"oracles": True}),
            ("1", {"oracles": ("reference",)}),
            # At 3 and 2x2 the reference is compared within the tolerance, not bitwise, as the
            # plain model is: in the default tier the plain model alone (the reference would
            # train every case there for it, 40% of those meshes' time); in the full tier the
            # reference too, whose own runs there it reads back.
            ("3,2x2", {"oracles": False, FULL_ORACLES: ("reference",), "patterns": MESH_BOUND}),
            ("3,2x2", {"oracles": ("reference",), "patterns": MESH_FREE, FULL: 1}),
            ("4", {"oracles": False, "patterns": AT_FOUR}),
            (
                "4",
                {
                    "oracles": False,
                    "patterns": [n for n in select(None) if n not in AT_FOUR],
                    FULL: 1,
                },
            ),
        ],
    ),
    "optimized-standin": (
        OPTIMIZED,
        [
            ("2", {"stand_in_streams": True, "oracles": False, "patterns": FOR_STREAMS}),
            ("2x2", {"stand_in_streams": True, "oracles": False, "patterns": AT_2X2}),
            (
                "2x2",
                {
                    "stand_in_streams": True,
                    "oracles": False,
                    "patterns": [n for n in FOR_STREAMS if n not in AT_2X2],
                    FULL: 1,  # the streams of 2 again (above): the same all-gathers
                },
            ),
            ("2x1,1x2", {"stand_in_streams": True, "oracles": False, "patterns": SHORTCUTS}),
            (
                "2x1,1x2",
                {
                    "stand_in_streams": True,
                    "oracles": False,
                    "patterns": [n for n in FOR_STREAMS if n not in SHORTCUTS],
                    FULL: 1,  # the same streams as at 2 and 2x2 (above)
                },
            ),
            (
                "3x1,1x3",
                {
                    "stand_in_streams": True,
                    "oracles": False,
                    "patterns": [n for n in FOR_STREAMS if n in NOT_COST],
                    # Full tier: the fuzzer's default sample runs stand-in streams at 3x1 and
                    # 1x3 (test_fuzz_parity.py), and the cases check the same stream order at
                    # 2x1 and 1x2; here it repeats them on every case (83 s of CI).
                    FULL: 1,
                },
            ),
        ],
    ),
    # torch's own fully_shard, with its expected failures (test_torch_conformance.py). At 2 its
    # runs are the optimized run's torch oracle, read back; 1 and 3 only check torch again on
    # meshes where the reference and the optimized path are checked case by case.
    "torch": (TORCH, [("2", {"oracles": False}), ("1,3", {"oracles": False, FULL: 1})]),
}
MESHES = {  # run -> [(mesh, run_suite options)], in the order they run
    run: [(m, options) for spec, options in parts for m in parse_meshes(spec)]
    for run, (_, parts) in RUNS.items()
}

_rows: dict[str, dict] = {}  # run -> {(mesh, case): row} of the meshes run so far
_done: dict[str, set] = {}  # run -> the indexes in MESHES[run] of the parts run so far
_folders: dict[str, str] = {}  # run -> the scratch folder its meshes share


def params(runs) -> list:
    """pytest parameters (run, mesh, case) for every case of every mesh of ``runs``, in the
    order they run; those of the full tier marked ``full``."""
    return [
        pytest.param(run, mesh_name(m), n, marks=[pytest.mark.full] if FULL in options else [])
        for run in runs
        for m, options in MESHES[run]
        for n in select(options.get("patterns"))
    ]


def meshes(run: str, full: bool = True) -> list[str]:
    """The meshes of ``run`` (without those of the full tier: ``full=False``)."""
    return [mesh_name(m) for m, options in MESHES[run] if full or FULL not in options]


def selected(run: str, mesh: str, full: bool = True) -> set[str]:
    """The cases the parts of ``run`` run on ``mesh`` (without the full tier's: ``full=False``)."""
    return {
        n
        for m, options in MESHES[run]
        if mesh_name(m) == mesh and (full or FULL not in options)
        for n in select(options.get("patterns"))
    }


def rows(run: str, mesh: str | None = None, full: bool | None = None, case: str | None = None):
    """The rows of ``run`` by (mesh, case), once its parts up to ``mesh``'s ran (all: None),
    those of the full tier with them where ``full`` (default: where the session runs the full
    tier; a default session must not run a full-tier part that comes before a mesh it asks
    for); with ``case``, up to the part of ``mesh`` that runs it (a mesh may have a default
    part and a full-tier part)."""
    full = FULL_TIER if full is None else full
    impl = RUNS[run][0]
    found = _rows.setdefault(run, {})
    done = _done.setdefault(run, set())
    if run not in _folders:
        _folders[run] = tempfile.mkdtemp(prefix=f"twinshard-suite-{run}-")
        atexit.register(functools.partial(shutil.rmtree, _folders[run], ignore_errors=True))
    folder = _folders[run]
    parts = [(i, s, o) for i, (s, o) in enumerate(MESHES[run]) if full or FULL not in o]
    if mesh is not None:
        mine = [i for i, s, o in parts if mesh_name(s) == mesh]
        if case is not None:
            mine = [i for i in mine if case in select(MESHES[run][i][1].get("patterns"))]
        parts = [p for p in parts if not mine or p[0] <= mine[-1]]
    for i, shape, options in parts:
        if i in done:
            continue
        if FULL_TIER and FULL_ORACLES in options:
            options = {**options, "oracles": options[FULL_ORACLES]}
        options = {k: v for k, v in options.items() if k not in (FULL, FULL_ORACLES)}
        with unmeasured(impl != OPTIMIZED):  # only the optimized path's lines are measured
            new = run_suite(impl, [shape], tmpdir=folder, **options)
        done.add(i)
        found.update({(r["mesh"], r["case"]): r for r in new})
        if report := os.environ.get("TWINSHARD_PARITY_REPORT"):
            with open(f"{report}.{run}.json", "w") as f:
                json.dump(list(found.values()), f, indent=1, default=str)
    return found
