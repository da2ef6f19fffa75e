"""A group whose parameters live on several meshes: one all-gather per mesh, chained.

``shard_placement_fn`` may give a parameter a mesh of its own (``ShardPlacementResult``): a
mixture-of-experts block shards its experts over the expert-data-parallel ranks and its router
and shared layers over the whole data-parallel mesh, in one ``fully_shard`` call. The
reference gathers and reduces each parameter over its own mesh (``ShardedParam.info``); this
path batches per mesh. Its all-gathers, one per mesh, are issued one after another, and the
result of the first carries the others (``AllGatherResult.then``), so that a group still has
one all-gather in flight to wait for and copy out (``copy_out`` follows the chain). Its
reductions go one per mesh and reduce dtype (``FlatParamGroup.reduce_grads_now``).

Such a group does not keep its blocks in storage of its own ([Note: the group keeps its blocks
padded] in ``flat_group.py``): that storage is laid out for one all-gather of every block.
"""

from __future__ import annotations

from .collectives import AllGatherResult, all_gather


def mesh_parts(params: list) -> list[list]:
    """``params`` split by the mesh each one is sharded over (its ``info``), in their order."""
    parts: dict[int, list] = {}
    for p in params:
        parts.setdefault(id(p.info), []).append(p)
    return list(parts.values())


def gather_each_mesh(group, params: list, written: bool) -> AllGatherResult:
    """Issue one all-gather of ``params`` (those of ``group`` still sharded) per mesh; returns
    the first one's result, which carries the next (``then``), and so on. ``written``: the
    shards were written on the current stream since the optimizer step. The process group's
    own memory (``set_allocate_memory_from_process_group_for_comm``) serves the group's mesh
    only, the one it was set for; each mesh keeps a cache of copy-out views of its own."""
    comm, custom = group.own_comm(), group.comms.all_gather
    results = []
    for part in mesh_parts(params):
        mesh = part[0].all_gather_mesh(group.post_forward_info)
        memory = group.comm_memory if part[0].info is group.info else None
        views = group.views.setdefault(id(part[0].info), {})
        dtypes = group.param_dtypes(part)
        results.append(
            all_gather(
                part,
                dtypes,
                mesh,
                comm,
                custom=custom,
                after_current=written,
                memory=memory,
                views=views,
            )
        )
    chained = None
    for result in reversed(results):
        own = result.own or (chained is not None and chained.own)
        chained = AllGatherResult(*result[:8], own=own, then=chained)  # pending ... views
    return chained
