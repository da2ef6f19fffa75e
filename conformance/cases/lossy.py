"""Cases of the communication variants (``twinshard.variants``), judged as lossy variants are
(``conformance/lossy.py``): tightly against the plain model with the variant's transform, and
within the budget that transform implies against the exact plain model; under the
implementation, the reference and torch's ``fully_shard`` where they run as oracles.

Blocks of 8 values, so that every parameter of the MLP spans several blocks and ends in a
partial one. qgZ by node and hpZ need nodes of 2 inside a shard group of at least 4 ranks.
"""

from __future__ import annotations

from twinshard.variants import Communication, Variant

from .. import models as M
from ..lossy import given_variant, train_lossy
from .core import case

BLOCK = 8


def _needs_nodes(ctx) -> bool:
    return ctx.shard_size >= 4 and ctx.shard_size % 2 == 0


def _run(ctx, variants: list[Variant], reshard_after_forward=None):
    return _judge(ctx, Communication(variants, reshard_after_forward))


def _judge(ctx, comm):
    """Train the MLP of 3 blocks under ``comm`` (hpZ: its ``reshard_after_forward``)."""
    hpz = getattr(comm, "reshard_after_forward", None)
    after = {} if hpz is None else {"reshard_after_forward": hpz}

    def wrap(impl, model, mesh):
        for block in model.blocks:
            impl.fully_shard(block, mesh=mesh, **after)
        impl.fully_shard(model, mesh=mesh)  # the root keeps its parameters after forward

    return train_lossy(ctx, M.mlp_recipe(ctx.world), comm, wrap)


def _sharded(ctx) -> bool:
    return ctx.shard_size > 1


WHY = "nothing is communicated within a shard group of one rank"


@case("lossy", needs=_sharded, why=WHY)
def case_lossy_qwz_int8(ctx):
    """qwZ: the weights all-gathered as int8 blocks with fp32 scales."""
    return _run(ctx, [Variant("qwz", 8, BLOCK)])


@case("lossy", needs=_sharded, why=WHY)
def case_lossy_qwz_int4(ctx):
    """qwZ in int4, two codes a byte."""
    return _run(ctx, [Variant("qwz", 4, BLOCK)])


@case("lossy", needs=_sharded, why=WHY)
def case_lossy_qgz_int8(ctx):
    """qgZ: gradients exchanged as int8 blocks by all-to-all, summed in fp32."""
    return _run(ctx, [Variant("qgz", 8, BLOCK)])


@case("lossy", needs=_sharded, why=WHY)
def case_lossy_qgz_int4(ctx):
    """qgZ in int4."""
    return _run(ctx, [Variant("qgz", 4, BLOCK)])


@case("lossy", needs=_sharded, why=WHY)
def case_lossy_bf16_wire(ctx):
    """Gradients sent in bf16, summed in fp32."""
    return _run(ctx, [Variant("bf16-wire")])


@case("lossy", needs=_sharded, why=WHY)
def case_lossy_qwz_qgz(ctx):
    """qwZ and qgZ together, in int8."""
    return _run(ctx, [Variant("qwz", 8, BLOCK), Variant("qgz", 8, BLOCK)])


@case("lossy", needs=_needs_nodes, why="needs a shard group of at least 4 ranks, in nodes of 2")
def case_lossy_qgz_by_node(ctx):
    """qgZ in two steps: within each node of 2, then across nodes."""
    return _run(ctx, [Variant("qgz", 8, BLOCK, ranks_per_node=2)])


@case("lossy", needs=_needs_nodes, why="needs a shard group of at least 4 ranks, in nodes of 2")
def case_lossy_zeropp_hpz(ctx):
    """ZeRO++ whole: qwZ, qgZ by node and hpZ (reshard_after_forward=2: backward gathers the
    kept, dequantized shard within the node)."""
    variants = [Variant("qwz", 8, BLOCK), Variant("qgz", 8, BLOCK, ranks_per_node=2)]
    return _run(ctx, variants, reshard_after_forward=2)


@case(
    "lossy",
    needs=lambda ctx: _sharded(ctx) and given_variant() is not None,
    why="give a variant: twinshard conform MODULE --variant MY_MODULE:NAME (and 2 ranks or more)",
)
def case_lossy_given(ctx):
    """The variant given with --variant (a researcher's own, or built-ins spelled as
    --variants spells them), judged as the built-in ones are."""
    return _judge(ctx, given_variant())
