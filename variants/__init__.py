"""Communication variants that change the numbers on purpose, on FSDP2's public extension
points, so that each runs under torch's ``fully_shard``, the reference and the optimized path.

| variant | replaces | wire bytes per element | file |
|---|---|---|---|
| qwZ int8 / int4 | the weights' all-gather | 1 + 4/B / 0.5 + 4/B (bf16: 2) | ``qwz.py`` |
| qgZ int8 / int4 | the gradients' reduce-scatter (all-to-all, fp32 sum) | 1 + 4/B / 0.5 + 4/B (fp32: 4) | ``qgz.py`` |
| qgZ by node | the same in two steps, within then across nodes | the same, 1/k across nodes | ``qgz.py``, ``nodes.py`` |
| fp8 (tensorwise, rowwise) | the weights' all-gather as e4m3 codes | 1 (rowwise: + 4/C) | ``fp8.py`` |
| bf16 wire | the gradients' reduce-scatter (all-to-all, fp32 sum) | 2 (fp32: 4) | ``bf16_wire.py`` |
| hpZ | nothing: ``fully_shard(..., reshard_after_forward=k)`` with k ranks per node keeps a node-local shard for backward's all-gather | - | ``hpz`` below |

B is the block (``block=256`` by default). ``blocks.py`` holds the quantization every
quantized variant shares; ``segments.py`` why blocks restart at each parameter; ``wire.py``
what every collective object shares (``allocate``, the bytes it sent); ``attach.py`` puts
variants on a sharded model; ``transform.py`` declares what they do to the numbers
(``Communication``, what ``twinshard conform`` certifies against a plain model)::

    from twinshard import variants
    fully_shard(block, mesh=mesh, reshard_after_forward=variants.hpz(8))  # hpZ, nodes of 8
    hooks = variants.attach(model, [variants.Variant("qwz"), variants.Variant("qgz")], mesh)
"""

from .attach import KINDS, Variant, attach, fsdp_modules, parse, problem, sent_bytes
from .transform import Communication

__all__ = ["KINDS", "Communication", "Variant", "attach", "fsdp_modules", "hpz", "parse"]
__all__ += ["problem", "sent_bytes"]


def hpz(ranks_per_node: int) -> int:
    """hpZ (ZeRO++ 3.2) as FSDP2 spells it: the ``reshard_after_forward`` that keeps, after
    forward, each parameter sharded over the ``ranks_per_node`` ranks of a node, so that
    backward's all-gather stays on the node's links. Pass it to ``fully_shard``."""
    if ranks_per_node < 1:
        raise ValueError(f"twinshard.variants: ranks_per_node must be >= 1, got {ranks_per_node}")
    return ranks_per_node
