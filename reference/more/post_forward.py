"""Second reading. ``reshard_after_forward``: what a group keeps between forward and backward.

``True`` frees every parameter after forward (each rank keeps only its 1/S block) and gathers
it again in backward over the shard group; ``False`` keeps the whole parameter until backward
is done. An int N (a divisor of S) is the middle ground: after forward each rank keeps 1/N of
the gathered parameter, and backward gathers it again among N neighbouring ranks, so that the
memory kept costs 1/N instead of all of it and the backward all-gather runs over N ranks (on a
machine of N GPUs: the fast links) instead of S.

The core sees one ``MeshInfo`` (or None): the mesh that backward's all-gather runs over. For
True it is the group's own; for N it is a second mesh viewing the same ranks as rows of N
(``rows_mesh``), built on the host even under a ``FakeTensorMode``, where the mesh's rank
tensor cannot be read. ``ShardedParam.reshard`` keeps the piece (``Layout.piece_to_keep``) and
``all_gather_mesh`` gathers it over this mesh.
"""

from __future__ import annotations

from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh

from twinshard.api.arguments import check_reshard_after_forward

from ..mesh import MeshInfo


def post_forward_mesh_info(reshard_after_forward: bool | int, info: MeshInfo) -> MeshInfo | None:
    """The mesh backward all-gathers a parameter over when forward resharded it: ``info`` to
    reshard fully (True, or N = S), None to keep it unsharded (False, or N = 1), else rows of N."""
    check_reshard_after_forward(reshard_after_forward, info.shard_size)
    n = reshard_after_forward
    if n is True:
        return info
    if n is False or n == 1:
        return None  # keeping a 1/1 piece is keeping the whole parameter
    if n == info.shard_size:
        return info
    # Rows of n consecutive ranks: rank r all-gathers with the others in its row in backward.
    small = rows_mesh(info.mesh, n)  # (S / n, n) ranks, built on the host
    return MeshInfo(small, small.get_group(1), n, small.get_local_rank(1))  # no replicas


def rows_mesh(mesh: DeviceMesh, n: int) -> DeviceMesh:
    """``mesh``'s ranks as rows of ``n`` consecutive ranks, (size / n, n), a new mesh."""
    with unset_fake_temporarily():  # the rank tensor's values, on the host
        return DeviceMesh(mesh.device_type, mesh.mesh.reshape(-1, n))
