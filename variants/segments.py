"""Which values of a collective's message belong to which parameter.

[Note: blocks never cross a parameter]
torch's ``fully_shard`` and the optimized path hand a custom collective one flat message per
parameter group: each parameter's padded shard, one after the other (an all-gather's input; a
reduce-scatter's input is one such chunk per rank). The reference hands it one parameter at a
time. If a quantized variant cut the flat message into blocks as it comes, a block would mix
the end of one parameter with the start of the next under torch, and not under the reference:
the same variant would give different numbers under each implementation, and no oracle could
say which is right. So a variant is told its module's parameters, cuts every message at their
boundaries and starts a new block at each: every implementation then sends the same blocks,
and the transform is defined per parameter, where a plain model can apply it too
(``conformance``'s lossy oracle). It costs one partial block per parameter: for a 4096 x 4096
weight sharded over 8 ranks with blocks of 256 values, none.
"""

from __future__ import annotations

import torch.nn as nn


def padded_numel(param, ranks: int) -> int:
    """The values of one rank's padded shard of ``param`` over ``ranks`` ranks: its shard
    dimension cut in ``ceil(size / ranks)`` rows, times the other dimensions."""
    placements = getattr(param, "placements", ())
    dim = next((p.dim for p in placements if hasattr(p, "dim")), 0)
    size = param.shape[dim] if param.dim() else 1
    rows = -(-size // ranks)
    return rows * (param.numel() // size if size else 0)


def managed_params(module: nn.Module) -> list[nn.Parameter]:
    """``module``'s parameters that no ``fully_shard``-ed module below it manages, in torch's
    order of a group's parameters: each module's own after those of its children (a post-order
    walk; ``fully_shard`` lays its messages out so), a parameter held twice counted once."""
    found: dict[int, nn.Parameter] = {}

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if not hasattr(child, "set_custom_all_gather"):  # a sharded child has its own
                visit(child)
        found.update(
            (id(p), p) for p in m._parameters.values() if p is not None and id(p) not in found
        )

    visit(module)
    return list(found.values())


class Layout:
    """The segments of the messages of ``module`` (or of a list of modules sharded as one
    group, ``fully_shard([norm, head])``: their parameters in the list's order):
    ``split(numel, ranks)`` gives the numel of each parameter's piece of a message of ``numel``
    values per rank, for a group of ``ranks``.

    After forward with ``reshard_after_forward=k`` (hpZ) a rank keeps the pieces of ``S / k``
    ranks of the full mesh's layout (S ranks), and backward gathers those from the node's k:
    such a message is that layout ``S / k`` times over."""

    def __init__(self, module: nn.Module | list[nn.Module], name: str = ""):
        modules = list(module) if isinstance(module, (list, tuple)) else [module]
        self.name = name or type(modules[0]).__name__
        found = [p for m in modules for p in managed_params(m)]
        self.params = list({id(p): p for p in found}.values())  # a tie counted once
        mesh = getattr(self.params[0], "device_mesh", None) if self.params else None
        self.mesh_ranks = mesh.mesh.shape[-1] if mesh is not None else None

    def params_with_grads(self) -> list:
        """The parameters a reduce-scatter's message holds: those that take gradients."""
        return [p for p in self.params if p.requires_grad]

    def params_of(self, numel: int, ranks: int) -> list | None:
        """The parameters whose pieces a message of ``numel`` values per rank holds, in order,
        where it is the group's message over ``ranks`` ranks; None where it is not."""
        pieces = [padded_numel(p, ranks) for p in self.params]
        if numel != sum(pieces):
            return None
        return [p for p, n in zip(self.params, pieces) if n]

    def split(self, numel: int, ranks: int, grads: bool = False) -> list[int]:
        params = self.params_with_grads() if grads else self.params
        layouts = [(ranks, 1)]  # (ranks the pieces are cut for, copies in one message)
        if self.mesh_ranks and self.mesh_ranks > ranks and self.mesh_ranks % ranks == 0:
            layouts.append((self.mesh_ranks, self.mesh_ranks // ranks))
        for cut, copies in layouts:
            pieces = [padded_numel(p, cut) for p in params]
            if numel == copies * sum(pieces):  # a group's message (torch's, optimized)
                return [n for n in pieces if n] * copies
            if numel in [copies * n for n in pieces]:  # one parameter's (the reference's)
                return [numel // copies] * copies
        raise ValueError(
            f"twinshard.variants: module {self.name}: a message of {numel} values per rank is "
            f"neither its parameters' padded shards over {ranks} ranks "
            f"({[padded_numel(p, ranks) for p in params]}) nor one of them; attach the variant "
            "after fully_shard, to the module it was made for"
        )
