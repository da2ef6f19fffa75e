"""Second reading. Parameters used on some ranks only, and why that must not hang, crash or mix gradients.

With routing (mixture of experts) or a branch taken on one rank only, a parameter gets a
gradient on some ranks only. Reduce-scattering just the gradients a rank has would issue
collectives of different sizes (gloo aborts), numbers (a hang) or, worse, parameters (silently
mixed gradients). So every trainable parameter of a group takes part in every reduction, zeros
from the ranks that did not use it, and every rank keeps the exact sum: after any backward all
ranks hold a gradient of a parameter or none does. One that no rank used keeps none, as under
torch's FSDP2: ``twinshard.guard.unused_grads`` drops it once the ranks' tally, over the job's
store rather than a collective (``twinshard.guard.usage``), says so.

Whether that is what the user meant is another question. A parameter used on some ranks but
not all is named on every rank at the root's next forward or optimizer step (at the end of the
backward with ``TWINSHARD_DEBUG=1``), unless the user said so with
``set_reduce_scatter_unused_params(True)``; then nothing is tallied, as in torch's FSDP2.
"""

from __future__ import annotations

from twinshard.guard import unused_grads


def check_usage(root, groups: list) -> None:
    """End of ``root``'s backward (the root's state; ``groups`` its ``ParamGroup``s, each with
    the ``usage`` of this backward): the tally, the gradients settled, the report deferred
    (``twinshard.guard.unused_grads.end_of_backward`` for both implementations)."""
    unused_grads.end_of_backward(root, groups)
