"""Cases of the communication variants (``twinshard.variants``), judged as lossy variants are
(``conformance/lossy.py``): tightly against the plain model with the variant's transform, and
within the budget that transform implies against the exact plain model; under the
implementation, the reference and torch's ``fully_shard`` where they run as oracles.

Blocks of 8 values, so that every parameter of the small MLP spans several blocks and ends in a
partial one; the default block of 256 on a wider MLP (``WIDE``); bf16 ``param_dtype`` with an
fp32 and a bf16 ``reduce_dtype``. qgZ by node and hpZ need nodes of 2 inside a shard group of
at least 4 ranks.
"""

from __future__ import annotations

import torch

from twinshard.models import MLPStack
from twinshard.variants import Communication, Variant

from .. import models as M
from ..lossy import given_variant, train_lossy
from .core import case

BLOCK = 8
# Shards of many blocks of the default 256 values, ending inside one, at 2, 3 and 4 ranks (the
# weights' 301 rows leave the last of 3 or 4 ranks a shorter, padded shard), beside biases and
# norms smaller than one block.
WIDE = dict(dim=48, hidden=301, n_blocks=2)
WIDE_MODEL = dict(build=lambda: MLPStack(**WIDE), data=M.mlp_data(WIDE["dim"]))


def needs_nodes(ctx) -> bool:
    return ctx.shard_size >= 4 and ctx.shard_size % 2 == 0


def _run(ctx, variants: list[Variant], reshard_after_forward=None, **model):
    return judge(ctx, Communication(variants, reshard_after_forward), **model)


def judge(ctx, comm, model: dict | None = None, param=None, reduce=None):
    """Train an MLP under ``comm`` (hpZ: its ``reshard_after_forward``, on the blocks): the
    small one of 3 blocks, or ``model``'s (``build`` and ``data``, such as ``WIDE_MODEL``);
    with ``param``, under a ``MixedPrecisionPolicy`` of that ``param_dtype`` and ``reduce``
    (its ``reduce_dtype``)."""
    hpz = getattr(comm, "reshard_after_forward", None)

    def wrap(impl, model, mesh):  # called once per run: the oracles' too
        policy = {}
        if param is not None:
            policy["mp_policy"] = impl.MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)
        after = {} if hpz is None else {"reshard_after_forward": hpz}
        for block in model.blocks:
            impl.fully_shard(block, mesh=mesh, **after, **policy)
        impl.fully_shard(model, mesh=mesh, **policy)  # the root keeps its parameters after forward

    shapes = dict(model or {})
    if param is not None:
        shapes |= dict(low_precision=param, low_reduce=reduce or torch.float32)
    if reduce not in (None, torch.float32):  # one step: the rounding FSDP's own division and
        shapes["steps"] = 1  # replicas' all-reduce add in bf16 would move the next ones' codes
    return train_lossy(ctx, M.mlp_recipe(ctx.world, **shapes), comm, wrap)


def sharded(ctx) -> bool:
    return ctx.shard_size > 1


WHY = "nothing is communicated within a shard group of one rank"


@case("lossy", needs=sharded, why=WHY)
def case_lossy_qwz_int8(ctx):
    """qwZ: the weights all-gathered as int8 blocks with fp32 scales."""
    return _run(ctx, [Variant("qwz", 8, BLOCK)])


@case("lossy", needs=sharded, why=WHY)
def case_lossy_qwz_int4(ctx):
    """qwZ in int4, two codes a byte."""
    return _run(ctx, [Variant("qwz", 4, BLOCK)])


@case("lossy", needs=sharded, why=WHY)
def case_lossy_qgz_int8(ctx):
    """qgZ: gradients exchanged as int8 blocks by all-to-all, summed in fp32."""
    return _run(ctx, [Variant("qgz", 8, BLOCK)])


@case("lossy", needs=sharded, why=WHY)
def case_lossy_qgz_int4(ctx):
    """qgZ in int4."""
    return _run(ctx, [Variant("qgz", 4, BLOCK)])


@case("lossy", needs=sharded, why=WHY)
def case_lossy_bf16_wire(ctx):
    """Gradients sent in bf16, summed in fp32."""
    return _run(ctx, [Variant("bf16-wire")])


@case("lossy", needs=sharded, why=WHY)
def case_lossy_qwz_qgz(ctx):
    """qwZ and qgZ together, in int8."""
    return _run(ctx, [Variant("qwz", 8, BLOCK), Variant("qgz", 8, BLOCK)])


@case("lossy", needs=sharded, why=WHY)
def case_lossy_default_block(ctx):
    """qwZ and qgZ in int8 at the default block, on shards of many blocks."""
    return _run(ctx, [Variant("qwz"), Variant("qgz")], model=WIDE_MODEL)


@case("lossy", needs=sharded, why=WHY)
def case_lossy_default_block_int4(ctx):
    """qwZ and qgZ in int4 at the default block: odd shard lengths packed two codes a byte."""
    return _run(ctx, [Variant("qwz", 4), Variant("qgz", 4)], model=WIDE_MODEL)


@case("lossy", needs=sharded, why=WHY)
def case_lossy_qwz_bf16(ctx):
    """qwZ under bf16 mixed precision: quantized and dequantized in the all-gather's bf16."""
    return _run(ctx, [Variant("qwz", 8, BLOCK)], param=torch.bfloat16, reduce=torch.float32)


@case("lossy", needs=sharded, why=WHY)
def case_lossy_qwz_qgz_bf16(ctx):
    """qwZ and qgZ under bf16 mixed precision, gradients reduced from bf16."""
    variants = [Variant("qwz", 8, BLOCK), Variant("qgz", 8, BLOCK)]
    return _run(ctx, variants, param=torch.bfloat16, reduce=torch.bfloat16)


@case("lossy", needs=needs_nodes, why="needs a shard group of at least 4 ranks, in nodes of 2")
def case_lossy_qgz_by_node(ctx):
    """qgZ in two steps: within each node of 2, then across nodes."""
    return _run(ctx, [Variant("qgz", 8, BLOCK, ranks_per_node=2)])


@case("lossy", needs=needs_nodes, why="needs a shard group of at least 4 ranks, in nodes of 2")
def case_lossy_zeropp_hpz(ctx):
    """ZeRO++ whole: qwZ, qgZ by node and hpZ (reshard_after_forward=2: backward gathers the
    kept, dequantized shard within the node)."""
    variants = [Variant("qwz", 8, BLOCK), Variant("qgz", 8, BLOCK, ranks_per_node=2)]
    return _run(ctx, variants, reshard_after_forward=2)


@case("lossy", needs=sharded, why=WHY)
def case_lossy_fp8(ctx):
    """fp8: the weights all-gathered as e4m3 codes at one scale per parameter, agreed across
    the shard group (torchao's float8 all-gather, for every parameter)."""
    return _run(ctx, [Variant("fp8")])


@case("lossy", needs=sharded, why=WHY)
def case_lossy_fp8_rows_bf16(ctx):
    """fp8 with a scale per row, with qgZ, under bf16 mixed precision: dequantized into bf16."""
    variants = [Variant("fp8", rows=True), Variant("qgz", 8, BLOCK)]
    return _run(ctx, variants, param=torch.bfloat16, reduce=torch.float32)


@case("lossy", needs=needs_nodes, why="needs a shard group of at least 4 ranks, in nodes of 2")
def case_lossy_fp8_hpz(ctx):
    """fp8 weights with hpZ (backward gathers forward's dequantized values within the node)
    and qgZ by node."""
    variants = [Variant("fp8"), Variant("qgz", 8, BLOCK, ranks_per_node=2)]
    return _run(ctx, variants, reshard_after_forward=2)


@case(
    "lossy",
    needs=lambda ctx: sharded(ctx) and given_variant() is not None,
    why="give a variant: twinshard conform MODULE --variant MY_MODULE:NAME (and 2 ranks or more)",
)
def case_lossy_given(ctx):
    """The variant given with --variant (a researcher's own, or built-ins spelled as
    --variants spells them), judged as the built-in ones are, in fp32 and under bf16 mixed
    precision, on the small MLP or, where its block is not much smaller than that model's
    shards, on the wide one (``_given_model``)."""
    comm = given_variant()
    wide, warning = _given_model(comm, ctx.shard_size)
    model = WIDE_MODEL if wide else None
    checker = judge(ctx, comm, model)
    checker.absorb(judge(ctx, comm, model, param=torch.bfloat16, reduce=torch.float32))
    checker.notes += [warning] if warning else []
    return checker


def _given_model(comm, ranks: int) -> tuple[bool, str | None]:
    """Whether the given variant runs on the wide MLP, and a warning where even that model's
    largest shard holds fewer than 4 of its blocks: one scale per block is then nearly one
    scale per tensor, and a mistake in how blocks are cut may not show."""
    from twinshard.variants.segments import padded_numel

    block = max((getattr(v, "block", 0) for v in getattr(comm, "variants", [])), default=0)
    block = block or getattr(comm, "block", 0)
    largest = {}
    for wide, build in ((False, M.mlp_recipe(ranks).build), (True, WIDE_MODEL["build"])):
        largest[wide] = max(padded_numel(p, ranks) for p in build().parameters())
    wide = block * 4 > largest[False]
    if block * 4 <= largest[wide]:
        return wide, None
    return wide, (
        f"warning: blocks of {block} values are not much smaller than the shards they run on "
        f"(the largest holds {largest[wide]} values at {ranks} ranks): a mistake in how "
        "blocks are cut may not show; certify with a smaller block too"
    )
