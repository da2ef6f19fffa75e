"""Fuzzed parity in CI: random models, meshes, policies and accumulation patterns (drawn by
hypothesis from ``twinshard.conformance.fuzz_draw``, with a fixed seed, so every run checks the
same examples), each trained by the plain model, the reference and the optimized path and
compared every step with the conformance suite's tolerances (``conformance.fuzz``).

One process group per mesh runs all of that mesh's examples: launching one per example would
cost more than the examples. ``benchmarks/fuzz_parity.py`` runs many more; every failure it
finds is added to ``REGRESSIONS`` below, by name, with its fix.

A second sample runs the optimized path on stand-in streams with the stream sanitizer on
(``Example.stand_in``), on HSDP with one shard (2x1, 3x1) and with one replica (1x2, 1x3) and
at world size 2; each mesh's sample includes an assign-load after the post-optimizer event, CPU
offload, a group of mixed dtypes and, on HSDP, partial sums kept across backwards
(``set_requires_all_reduce(False)``): where the three stream races of issue 23 (hazards 3-5)
were. A race stops the ranks (``StreamOrderError``), and the launch names the example. A
planted copy of hazard 5 must be caught.
"""

from __future__ import annotations

import math

import pytest

from twinshard.conformance.fuzz import Example, run_examples
from twinshard.conformance.fuzz_draw import draw
from twinshard.conformance.suite import mesh_name
from twinshard.ranks.launch import LaunchError, launch

SEED = 2026
# mesh -> examples drawn for it: 54 in all. The default tier checks the first DEFAULT of each
# mesh's sample (23 in all); the full tier (--full) the rest: more examples of the same kinds of
# model, mesh and policy on the same meshes, which benchmarks/fuzz_parity.py's long runs cover
# by the hundred.
PLAN = {(1,): 12, (2,): 14, (1, 2): 8, (2, 1): 6, (3,): 5, (4,): 4, (2, 2): 5}
DEFAULT = {(1,): 4, (2,): 5, (1, 2): 3, (2, 1): 3, (3,): 3, (4,): 2, (2, 2): 3}
# Failures the long run found, each kept as a named example (see the module docstring).
REGRESSIONS = [
    # fp32 3e-5 off the full-batch truth, as far as the plain model's own data-parallel
    # computation: fp32 is judged against that error now ([Note: fp32 judged like low
    # precision] in conformance/fuzz.py).
    Example(
        name="ill_conditioned_fp32",
        mesh=(2,),
        widths=(3, 7, 1, 37, 3),
        bias=(False, False, False, False),
        norm=(True, False, False, True),
        own_group=(False, True, True, False),
        frozen=(False, False, False, True),
        reshard=(False, None, 2),
        offload=(True, False, False),
        micro=3,
        sync_off=("model", "blocks"),
        steps=3,
    ),
    # Every weight frozen or tied to a frozen one: backward had nothing to do and raised; the
    # fuzzer's model keeps one bias trainable now.
    Example(
        name="all_frozen_but_one_bias",
        mesh=(2,),
        widths=(15, 15),
        bias=(False,),
        norm=(False,),
        own_group=(False,),
        frozen=(True,),
        tie=True,
        frozen_inp=True,
        reshard=(2,),
        offload=(True,),
        policy="bf16/bf16",
        micro=3,
        sync_off=("reshard_after_backward", "reshard_after_backward"),
        steps=1,
        clip=1.0,
    ),
    # bf16, three steps: 3x past twice the plain model's error at step 3, reference and
    # optimized equal; two bf16 computations part after the first step, so low precision
    # trains one ([Note: one step in low precision]).
    Example(
        name="bf16_no_sync_world_3",
        mesh=(3,),
        widths=(7, 5, 7),
        bias=(False, False),
        norm=(True, True),
        own_group=(False, True),
        frozen=(False, True),
        reshard=(3, None),
        offload=(True, False),
        policy="bf16/bf16",
        micro=2,
        sync_off=("reshard_after_backward",),
        steps=1,
    ),
]


def _verdicts(examples: list[Example], mesh: tuple, impls=None) -> list[dict]:
    texts = [e.to_json() for e in examples]
    extra = () if impls is None else (impls,)
    return launch(run_examples, math.prod(mesh), texts, mesh, *extra, timeout=300)[0]


def _report(verdicts: list[dict]) -> str:
    failed = [v for v in verdicts if not v["ok"]]
    return "\n".join(f"{v['example']}\n  " + "\n  ".join(v["failures"][:3]) for v in failed)


def _sample(mesh: tuple) -> list[Example]:
    examples = draw(PLAN[mesh], SEED + list(PLAN).index(mesh), mesh)
    assert len(examples) >= PLAN[mesh] - 1, "hypothesis drew fewer examples than planned"
    return examples


def _check(examples: list[Example], mesh: tuple) -> None:
    assert examples
    verdicts = _verdicts(examples, mesh)
    assert len(verdicts) == len(examples)
    assert all(v["ok"] for v in verdicts), _report(verdicts)  # one that raised: its traceback
    assert all(v["compared"] > 0 for v in verdicts), "an example compared nothing"


@pytest.mark.parametrize("mesh", list(PLAN), ids=mesh_name)
def test_fuzzed_parity(mesh):
    _check(_sample(mesh)[: DEFAULT[mesh]], mesh)


@pytest.mark.full
@pytest.mark.parametrize("mesh", list(PLAN), ids=mesh_name)
def test_more_fuzzed_parity(mesh):
    _check(_sample(mesh)[DEFAULT[mesh] :], mesh)


# Gradient sync off on two of three micro-batches, bf16 reduce dtype, 3 ranks: the oracle
# summed the micro-batches in fp32, FSDP sums them in bf16 on each rank (2.8x past the bound,
# reference and optimized alike); the oracle does as FSDP now (``Recipe.low_accumulate``).
REGRESSIONS += [
    Example(
        name=f"bf16_unsynced_micro_batches_world_3{'_norm' if norm else ''}",
        mesh=(3,),
        widths=(7, 1, 1, 7),
        bias=(False, False, True),
        norm=(False, norm, norm),
        own_group=(False, True, True),
        frozen=(False, False, False),
        tie=True,
        reshard=(None, True, True),
        offload=(False, True, False),
        policy="bf16/default",
        micro=3,
        sync_off=("model", "model"),
        steps=1,
    )
    for norm in (False, True)
]

REGRESSION_MESHES = sorted({tuple(e.mesh) for e in REGRESSIONS})


@pytest.mark.parametrize("mesh", REGRESSION_MESHES, ids=mesh_name)
def test_regressions(mesh):
    examples = [e for e in REGRESSIONS if tuple(e.mesh) == mesh]
    verdicts = _verdicts(examples, mesh)
    assert all(v["ok"] for v in verdicts), _report(verdicts)


# A failure of the tolerance, not of an implementation (both are FSDP done right): bf16
# gradients of 4 ranks summed in another order. One bias's per-rank gradients cancel (0.25 and
# 0.13 summing to 0.19 in the mean); the 24 orders of those 4 bf16 additions err by 2.6e-4 to
# 1.2e-3, the plain model's sequential order is the luckiest and gloo's the unluckiest, so
# "twice the plain model's error plus one rounding at the tensor's magnitude" does not hold.
# Fixing it belongs to the low-precision class (a rounding at the summands' magnitude).
BF16_SUM_ORDER = Example(
    name="bf16_sum_order_world_4",
    mesh=(4,),
    widths=(3, 3),
    bias=(True,),
    norm=(False,),
    own_group=(False,),
    frozen=(True,),
    frozen_inp=True,
    reshard=(None,),
    offload=(False,),
    policy="bf16/bf16",
    clip=1.0,
    steps=1,
)


def test_known_limit_bf16_sum_order():
    """Fails the bound, for this reason only; once the bound holds, move the example to
    ``REGRESSIONS``. Since the optimized path's flat buffer follows torch's order of a group's
    parameters (depth first), it adds this bias's bf16 gradients as the reference does, and
    misses the bound by the same amount."""
    (verdict,) = _verdicts([BF16_SUM_ORDER], (4,))
    assert not verdict["ok"], "the bound holds now: move BF16_SUM_ORDER to REGRESSIONS"
    assert all(
        "step 0 grad 'blocks.0.lin.bias'" in f and "2 x plain low-precision" in f
        for f in verdict["failures"]
    ), verdict["failures"]


# The long run of 2026-11-22 (benchmarks/fuzz_parity.py --examples 400 --seed 23: 398 drawn, 5
# failed) found five more of the same class: bf16 gradients of 3 or 4 ranks summed in gloo's
# order, past "twice the plain model's error plus one rounding" by 1.5x to 6.7x, the reference
# and the optimized path alike (and, at world size 3, each other: the flat reduce-scatter adds
# in another order than the per-parameter one). Known limits of the bound, kept as such.
BF16_SUM_ORDER_LONG_RUN = [  # as benchmarks/fuzz_parity.py prints them (--replay runs one)
    '{"mesh":[3],"widths":[3,15,3],"bias":[false,false],"norm":[false,true],"own_group":[false,false],"frozen":[false,false],"tie":true,"frozen_inp":false,"reshard":[false],"offload":[false],"policy":"bf16/bf16","micro":2,"sync_off":["root_only"],"steps":1,"clip":1.0,"name":"bf16_sum_order_long_run_1"}',
    '{"mesh":[4],"widths":[1,5,15,1],"bias":[true,true,false],"norm":[true,false,false],"own_group":[false,true,false],"frozen":[false,true,true],"tie":false,"frozen_inp":true,"reshard":[1,1],"offload":[true,true],"policy":"bf16/default","micro":2,"sync_off":["blocks"],"steps":1,"clip":null,"name":"bf16_sum_order_long_run_2"}',
    '{"mesh":[4],"widths":[7,2,5,2,7],"bias":[false,true,false,false],"norm":[false,false,true,true],"own_group":[true,false,false,true],"frozen":[false,false,true,true],"tie":false,"frozen_inp":false,"reshard":[null,true,false],"offload":[false,true,false],"policy":"bf16/bf16","micro":1,"sync_off":[],"steps":1,"clip":null,"name":"bf16_sum_order_long_run_3"}',
    '{"mesh":[4],"widths":[7,1,7],"bias":[true,false],"norm":[true,true],"own_group":[false,false],"frozen":[false,true],"tie":false,"frozen_inp":true,"reshard":[null],"offload":[false],"policy":"bf16/bf16","micro":1,"sync_off":[],"steps":1,"clip":null,"name":"bf16_sum_order_long_run_4"}',
    '{"mesh":[4],"widths":[7,1,7],"bias":[true,false],"norm":[true,true],"own_group":[false,false],"frozen":[false,false],"tie":false,"frozen_inp":true,"reshard":[null],"offload":[false],"policy":"bf16/bf16","micro":1,"sync_off":[],"steps":1,"clip":null,"name":"bf16_sum_order_long_run_5"}',
]


# The sanitized long run of 2026-11-24 (benchmarks/fuzz_parity.py --examples 540
# --stand-in-streams --seed 23: 524 drawn, no stream-order violation) found one more, at world
# size 3: a LayerNorm bias's bf16 gradient just past the bound (2.54e-4 against 2.43e-4), the
# reference and the optimized path alike.
BF16_SUM_ORDER_LONG_RUN.append(
    '{"mesh":[3],"widths":[7,2,3,2,7],"bias":[false,true,false,true],"norm":[true,false,true,true],"own_group":[true,false,true,true],"frozen":[true,true,false,false],"tie":false,"frozen_inp":false,"reshard":[null,null,false,3],"offload":[false,false,false,false],"policy":"bf16/bf16","micro":1,"sync_off":[],"steps":1,"clip":null,"name":"bf16_sum_order_long_run_6","scale":[null,null,null,null],"reload":null,"stand_in":true}'
)


@pytest.mark.parametrize("mesh", [(3,), (4,)], ids=mesh_name)
def test_known_limit_bf16_sum_order_long_run(mesh):
    """Each fails the low-precision bound and nothing else; once one holds, move it."""
    examples = [e for e in map(Example.from_json, BF16_SUM_ORDER_LONG_RUN) if e.mesh == mesh]
    assert examples
    verdicts = _verdicts(examples, mesh)
    assert len(verdicts) == len(examples) and not any(v["ok"] for v in verdicts)
    for v in verdicts:
        assert all("2 x plain low-precision" in f for f in v["failures"]), v["failures"]


# mesh -> (examples, seed) of the sample whose optimized path runs on stand-in streams under
# the sanitizer: 30 in all, about 30 s on 2 busy cores. Each seed is SEED + 10 + the mesh's index
# but 1x2's: with 2038 (its first) it held FP32_AMPLIFIED_GRAD_NORM (below), a limit of the bound.
SANITIZED_PLAN = {(2,): (6, 2036), (2, 1): (6, 2037), (1, 2): (6, 2078), (3, 1): (6, 2039)}
SANITIZED_PLAN[(1, 3)] = (6, 2040)


def _sanitized_sample(mesh: tuple) -> list[Example]:
    count, seed = SANITIZED_PLAN[mesh]
    return draw(count, seed, mesh, stand_in=True)


def _situations(example: Example) -> set[str]:
    found = set()
    if example.reload:
        found.add("assign-load after the post-optimizer event")
    if any(example.offload):
        found.add("CPU offload")
    if any(dtype is not None for dtype in example.scale):
        found.add("mixed dtypes")
    if "all_reduce" in example.sync_off:
        found.add("partial sums")
    return found


@pytest.mark.parametrize("mesh", list(SANITIZED_PLAN), ids=mesh_name)
def test_sanitized_fuzzed_parity(mesh):
    examples = _sanitized_sample(mesh)
    assert len(examples) == SANITIZED_PLAN[mesh][0] and all(e.stand_in for e in examples)
    wanted = {"assign-load after the post-optimizer event", "CPU offload", "mixed dtypes"}
    if len(mesh) == 2:
        wanted.add("partial sums")
    missing = wanted - set().union(*map(_situations, examples))
    assert not missing, f"the seeded sample lacks {missing}: draw more, or change its seed"
    verdicts = _verdicts(examples, mesh)
    assert len(verdicts) == len(examples)
    assert all(v["compared"] > 0 for v in verdicts), _report(verdicts)
    assert all(v["ok"] for v in verdicts), _report(verdicts)


def test_a_planted_stream_race_is_caught():
    """Hazard 5 of issue 23 planted back (the copy-in waits only on the post-optimizer event,
    not on the compute stream that wrote the assign-loaded shards after it): the sanitized
    fuzzer fails the examples that the optimized path passes, naming the unordered read."""
    # test_sanitized_fuzzed_parity[2] passes the same examples unplanted
    examples = [e for e in _sanitized_sample((2,)) if e.reload]
    assert examples
    planted = ("twinshard.reference", "twinshard.conformance.planted.optimized_event_only")
    with pytest.raises(LaunchError) as caught:  # a race stops the ranks, naming the example
        _verdicts(examples, (2,), planted)
    report = str(caught.value)
    assert f"example {examples[0].to_json()} raised StreamOrderError" in report, report[-3000:]
    assert "on stream 'copy_in" in report and "without waiting for it" in report, report[-3000:]


def test_a_planted_bug_is_caught():
    """The same harness fails an implementation whose gradients are 0.1% too large."""
    # fp32 and unclipped: clipping rescales the bug away, and 0.1% is below one bf16 rounding
    examples = [e for e in draw(30, SEED, (2,)) if e.clip is None and not e.low_precision][:3]
    planted = ("twinshard.reference", "twinshard.conformance.planted.scaled_grads")
    verdicts = _verdicts(examples, (2,), planted)
    assert len(verdicts) == 3 and not any(v["ok"] for v in verdicts), _report(verdicts)
    assert all("scaled_grads step" in v["failures"][0] for v in verdicts)


# Found by the sanitized sample's first seed for 1x2 (2038), and at world size 2 without HSDP or
# stand-in streams alike: fp32, clipped, a frozen bf16 scale, gradient sync off on some groups.
# The reference and the optimized path agree bitwise; both report a step-1 gradient norm
# (pre-clip, 7.991) 9.1e-5 off the truth, a relative 1.1e-5, where the plain model's own
# data-parallel fp32 run is 4.8e-7 off. Every shard of every gradient and parameter is within
# the bound: the step-0 parameters differ by 1.5e-8 (the ranks' gradients summed in another
# order), and this ill-conditioned model (a 1-row layer into a LayerNorm) amplifies that ~700x
# by step 1, in another direction than the plain model's own realization ([Note: fp32 judged
# like low precision] in conformance/fuzz.py). The norm, one number over all gradients, gets
# the floor of one element (atol 1e-5). A limit of the bound, kept as such; whether the norm
# misses it depends on the CPU (see the test).
FP32_AMPLIFIED_GRAD_NORM = (
    '{"mesh":[1,2],"widths":[3,37,1,3],"bias":[false,false,false],"norm":[false,false,true],'
    '"own_group":[false,true,false],"frozen":[false,false,false],"tie":true,"frozen_inp":true,'
    '"reshard":[false,true],"offload":[true,false],"policy":"fp32","micro":3,'
    '"sync_off":["all_reduce","blocks"],"steps":2,"clip":1.0,"name":"fp32_amplified_grad_norm",'
    '"scale":["bfloat16",null,"bfloat16"],"reload":null,"stand_in":true}'
)


def test_known_limit_fp32_amplified_grad_norm():
    """At the bound's edge: the step-1 gradient norm is the one figure that may miss it, as this
    CPU's fp32 kernels round the sums that the model amplifies (it missed on the machines of
    earlier sessions and holds on the Xeon of 2026-11-27's evening, the same code failing the
    old form of this test there); every other figure holds everywhere."""
    (verdict,) = _verdicts([Example.from_json(FP32_AMPLIFIED_GRAD_NORM)], (1, 2))
    assert all("step 1 grad norm" in f for f in verdict["failures"]), verdict["failures"]
