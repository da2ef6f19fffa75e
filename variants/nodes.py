"""Process groups by node, for the hierarchical exchanges (qgZ's two steps).

Ranks are numbered node by node, ``ranks_per_node`` to a node, as ``torchrun`` numbers them.
For every shard group of the mesh (one for FSDP, one per replica for HSDP) the groups within
each node and across nodes at each local index are made once, on every rank, in the same order
(``dist.new_group`` is collective), when a variant is attached; a collective then finds its own.
"""

from __future__ import annotations

import torch.distributed as dist


class NodeGroups:
    """``of(group)``: the (within this rank's node, across nodes at this rank's local index)
    groups of the shard group ``group``."""

    def __init__(self, mesh, ranks_per_node: int):
        if ranks_per_node < 1:
            raise ValueError(
                f"twinshard.variants: ranks_per_node must be >= 1, got {ranks_per_node}"
            )
        self.per_node = ranks_per_node
        shard_groups = mesh.mesh.reshape(-1, mesh.mesh.shape[-1]).tolist()  # (replicas, S)
        me = dist.get_rank()
        self.mine: dict[tuple, tuple] = {}
        for ranks in shard_groups:
            if len(ranks) % ranks_per_node:
                raise ValueError(
                    f"twinshard.variants: {len(ranks)} ranks per shard group do not make whole "
                    f"nodes of {ranks_per_node}"
                )
            k, nodes = ranks_per_node, len(ranks) // ranks_per_node
            within = [dist.new_group(ranks[m * k : (m + 1) * k]) for m in range(nodes)]
            across = [dist.new_group(ranks[p::k]) for p in range(k)]
            if me in ranks:
                i = ranks.index(me)
                self.mine[tuple(ranks)] = (within[i // k], across[i % k])

    def hierarchical(self, group) -> bool:
        """Whether a collective over ``group`` spans more than one node."""
        return 1 < self.per_node < dist.get_world_size(group)

    def of(self, group) -> tuple:
        key = tuple(dist.get_process_group_ranks(group))
        if key not in self.mine:
            raise ValueError(
                f"twinshard.variants: no node groups were made for the process group of ranks "
                f"{list(key)}; attach the variant with the mesh the module was sharded over"
            )
        return self.mine[key]
