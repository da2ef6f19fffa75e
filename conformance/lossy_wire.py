"""What a lossy run put on the wire, against the sizes its declared format gives.

``twinshard.variants``' formats are declared (``variants/blocks.py``): a message of a
parameter group is each parameter's padded shard cut at the parameters' boundaries
(``segments.py``), one fp32 scale per block and ``bits`` per code. So the bytes of every
message follow from the variant's bits and block and the model's parameters alone, without
asking the variant what it sent (fp8: a byte per code, and rowwise an fp32 scale per row):
``declared_sizes`` lists them (a group's message, as torch's ``fully_shard`` and the optimized
path send it, and one parameter's, as the reference does).
``check_wire`` then reads one run's collectives (``conformance.trace``):

- qwZ and fp8: at least one packed (uint8) all-gather, each of a declared size (ranks x
  message), and no floating-point all-gather but hpZ's within a node
  (``reshard_after_forward`` an int);
- qgZ: no floating-point reduce-scatter, and all-to-alls of packed bytes, each of a declared
  size (rows x message: a row per rank of the shard group; by node, the same within the node,
  whose ranks each send a row per node, then a row per node across the nodes);
- the bf16 wire: no floating-point reduce-scatter, and all-to-alls in bf16.
"""

from __future__ import annotations

import torch

from twinshard.variants import blocks, fp8
from twinshard.variants.segments import padded_numel

from .compare import Checker


def declared_sizes(comm, collective: str, ranks: int, rows: list[int]) -> set[int]:
    """The sizes (bytes, of the larger side) of every message the variant of ``collective``
    may send over a shard group of ``ranks``, ``rows`` messages at a time."""
    v = comm.weights if collective == "all_gather" else comm.grads
    sizes = set()
    for hooks in comm.hooks.values():
        layout = getattr(hooks.get(collective), "layout", None)
        if layout is None:
            continue
        params = layout.params if collective == "all_gather" else layout.params_with_grads()
        pieces = [n for n in (padded_numel(p, ranks) for p in params) if n]
        widths = [fp8.row_width(p.shape, v.rows) for p in params if padded_numel(p, ranks)]
        for segments, w in ((pieces, widths), *(([n], [w]) for n, w in zip(pieces, widths))):
            if v.kind == "fp8":  # a code a byte, and rowwise an fp32 scale per row
                message = fp8.packed_bytes(segments, w)
            else:
                message = blocks.packed_bytes(segments, v.bits, v.block)
            sizes.update(r * message for r in rows)
    return sizes


def check_wire(checker: Checker, comm, calls: list, label: str, ranks: int) -> None:
    """What ``calls`` (one sharded run's collectives over shard groups of ``ranks``) sent,
    against what ``comm``'s variants declare (see the module docstring)."""
    checker.count += 1
    floats = lambda op: [c for c in calls if c.op == op and c.dtype.is_floating_point]  # noqa: E731
    if comm.weights is not None:
        packed = [c.numel for c in calls if c.op == "all_gather" and c.dtype == torch.uint8]
        _sizes(
            checker,
            label,
            "all-gathers",
            packed,
            declared_sizes(comm, "all_gather", ranks, [ranks]),
            comm.weights,
        )
        if floats("all_gather") and comm.reshard_after_forward in (None, True, False):
            dtypes = sorted({str(c.dtype) for c in floats("all_gather")})
            checker.fail(f"{label}: {len(floats('all_gather'))} all-gathers sent {dtypes}")
    if comm.grads is not None:
        if floats("reduce_scatter"):
            checker.fail(f"{label}: {len(floats('reduce_scatter'))} floating reduce-scatters")
        wire = torch.bfloat16 if comm.grads.kind == "bf16-wire" else torch.uint8
        sent = [c.numel for c in calls if c.op == "all_to_all" and c.dtype == wire]
        if not sent:
            checker.fail(f"{label}: no all-to-all in {wire}: the gradients were not exchanged")
        elif wire == torch.uint8:
            k = comm.grads.ranks_per_node
            rows = [ranks] if k <= 1 or k >= ranks else [ranks, ranks // k]
            allowed = declared_sizes(comm, "reduce_scatter", ranks, rows)
            _sizes(checker, label, "all-to-alls", sent, allowed, comm.grads)


def _sizes(checker: Checker, label: str, what: str, sent: list, allowed: set, v) -> None:
    if not sent:
        checker.fail(f"{label}: no packed {what}: the variant sent no {v.describe()} message")
        return
    wrong = sorted(set(sent) - allowed)
    if wrong:
        shown = ", ".join(map(str, sorted(allowed)[:6]))
        checker.fail(
            f"{label}: packed {what} of {wrong} bytes, none of a size {v.describe()} gives "
            f"for this model's groups or parameters ({shown}, ...)"
        )
