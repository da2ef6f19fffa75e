"""Second reading. Parameters used on some ranks only: no hang, no crash, no mixed gradients.

With routing (mixture of experts) or a branch taken on one rank, a parameter gets a gradient on
some ranks only; reducing only the gradients a rank has would issue mismatched collectives
(gloo aborts, a hang, or silently mixed gradients). So every trainable parameter takes part in
every reduction, with zeros where unused, and all ranks keep the exact sum. One no rank used
keeps no gradient, as under torch's FSDP2, once the ranks' tally over the job's store says so
(``twinshard.guard``); one used on some ranks only is named at the root's next forward or
optimizer step, unless ``set_reduce_scatter_unused_params(True)`` said it is meant.
"""

from __future__ import annotations

from twinshard.guard import unused_grads


def check_usage(root, groups: list) -> None:
    """End of ``root``'s backward (the root's state; ``groups`` its ``ParamGroup``s, each with
    the ``usage`` of this backward): the tally, the gradients settled, the report deferred
    (``twinshard.guard.unused_grads.end_of_backward`` for both implementations)."""
    unused_grads.end_of_backward(root, groups)
