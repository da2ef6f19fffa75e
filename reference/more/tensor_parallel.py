"""Second reading. Cuts other than a plain parameter's rows: tensor parallelism, ``Shard(dim)``.

With tensor parallelism, ``parallelize_module(model, mesh["tp"], plan)`` makes a weight a
``DTensor`` on the ``tp`` mesh, each rank holding a TP piece, and ``fully_shard(block,
mesh=mesh["dp"])`` shards that *piece* over ``dp`` as it shards a whole parameter. The sharded
parameter is a ``DTensor`` on the dp and tp dims of the mesh both were cut from ((``dp``,
``tp``), or HSDP's (``replicate``, ``shard``, ``tp``) out of (``pp``, ``dp``, ``tp``)):
``Replicate`` on the replicate dim, ``Shard(dim)`` on the shard dim (``_StridedShard(dim)``
where TP cut the same dim), then TP's own; the unsharded parameter and its gradient are
``DTensor``s on the ``tp`` mesh, and FSDP reduces the gradient's piece (``TensorParallel``).

``dp_mesh_dims``: ``fully_shard`` gets the mesh every parallelism was cut from, (``dp_shard``,
``cp``, ``tp``) say, every parameter ``Replicate`` on the dims named data parallel, and reads
its data-parallel mesh from it as torch's FSDP2 does (``twinshard/api/arguments.py``: several
dims of a kind flattened into one, the replicate dim first; with replicate dims alone, DDP, the
mesh is (R, 1), so parameters stay whole and keep the user's layout). Such a parameter is
unsharded on the whole mesh, as torch's is; with dp dims only (torchtitan's ``full_dtensor``)
its local tensor is the whole parameter.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from twinshard.api import FSDPUsageError
from twinshard.api.arguments import dp_dims

from ..layout import Layout


class TensorParallel(Layout):
    """The layout of a ``DTensor`` parameter (tensor parallelism, or the whole SPMD mesh)."""

    plain = False

    def setup(self, *, param: DTensor, info, fqn: str, **_) -> None:
        """Find where the parameter lives and how FSDP's placement joins its own."""
        own = mesh, placements = param.device_mesh, tuple(param.placements)  # the unsharded's
        replicated, sharded, replicate_only = dp_dims(info.mesh)
        dp_names = (*replicated, *sharded)
        names = tuple(mesh.mesh_dim_names or ())
        if any(name in names for name in dp_names):  # on the whole mesh: drop its dp dims
            keep = [i for i, name in enumerate(names) if name not in dp_names]
            if any(not placements[i].is_replicate() for i, n in enumerate(names) if n in dp_names):
                raise FSDPUsageError(f"parameter '{fqn}' must be replicated on the dp mesh dims")
            placements = tuple(placements[i] for i in keep)
            mesh = mesh[tuple(names[i] for i in keep)] if keep else None  # None: dp dims only
        if any(not isinstance(p, (Shard, Replicate)) for p in placements):
            raise FSDPUsageError(f"parameter '{fqn}': TP placements {placements} unsupported")
        # DDP: the parameter keeps its layout
        spmd = param.device_mesh if replicate_only else spmd_mesh(info.mesh, mesh, dp_names)
        if spmd is None:
            raise FSDPUsageError(
                f"parameter '{fqn}' is a DTensor on a mesh not cut from the fully_shard mesh's "
                f"parent after its dims {dp_names}; build one named mesh (dp, tp or pp, dp, tp, "
                "say), pass mesh['tp'] to parallelize_module and mesh['dp'] to fully_shard"
            )
        self.tp_mesh, self.tp_own_placements = own  # the unsharded parameter lives here
        self.tp_placements = placements  # of its TP dims (none: a whole-mesh parameter)
        self.spmd_mesh = spmd  # (dp..., tp...): where the sharded parameter lives
        self.tp_shape, self.tp_stride = param.shape, param.stride()  # the whole parameter
        self.keeps_layout = replicate_only  # replicate-only dp_mesh_dims: sharded as it is

    def piece(self, param: DTensor) -> torch.Tensor:
        return param.to_local()  # the TP piece plays the part of the parameter

    def shard_spec(self, info, stride: tuple) -> tuple:
        if self.keeps_layout:  # nothing sharded: the parameter's own layout
            return self.tp_mesh, self.tp_own_placements, self.tp_stride
        cut_by_tp = any(isinstance(p, Shard) and p.dim == self.dim for p in self.tp_placements)
        tp_size = self.spmd_mesh.size() // info.mesh.size()
        fsdp = _StridedShard(self.dim, split_factor=tp_size) if cut_by_tp else Shard(self.dim)
        # the dims before FSDP's replicate (HSDP's one, or each dp_mesh_dims names)
        replicate = (Replicate(),) * (self.spmd_mesh.ndim - len(self.tp_placements) - 1)
        return self.spmd_mesh, (*replicate, fsdp, *self.tp_placements), self.tp_stride

    def unsharded(self, whole: torch.Tensor) -> DTensor:
        piece = super().unsharded(whole)
        mesh, placements = self.tp_mesh, self.tp_own_placements
        shape, stride = self.tp_shape, self.tp_stride
        return DTensor.from_local(
            piece, mesh, placements, run_check=False, shape=shape, stride=stride
        )

    def local_grad(self, grad: DTensor, reduce_dtype: torch.dtype) -> torch.Tensor:
        return super().local_grad(grad.to_local(), reduce_dtype)  # our piece of it


class ShardDim(Layout):
    """``shard_placement_fn``'s ``Shard(dim)``, dim > 0: blocks cut along ``dim``. Every block
    and collective still sees rows, the parameter viewed with ``dim`` first (``rows_first``, a
    transpose, its own inverse); the gathered rows, a transposed view, are copied into memory
    of the parameter's own (``own``, contiguous, as torch's), freed with them."""

    plain = False

    def setup(self, *, dim: int, **_) -> None:
        self.dim = dim  # the dim cut into blocks
        self.own: torch.Tensor | None = None  # the unsharded parameter's contiguous memory

    def rows_first(self, t: torch.Tensor) -> torch.Tensor:
        return t.transpose(0, self.dim)  # (rows along dim, ...)

    def unsharded(self, whole: torch.Tensor) -> torch.Tensor:
        self.own = torch.empty_like(whole, memory_format=torch.contiguous_format)  # (*shape)
        self.gathered, self.own_bytes = whole, self.own.untyped_storage().nbytes()
        return super().unsharded(self.own.data)  # ``.data``: see ``all_gather_output``

    def finish(self, p):
        self.own.untyped_storage().resize_(self.own_bytes)
        self.own.copy_(self.gathered)  # (rows along dim, ...) in the parameter's layout
        return super().finish(p)

    def free(self, p) -> None:
        super().free(p)
        self.own.untyped_storage().resize_(0)


def spmd_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh | None, dp_names: tuple):
    """Where a sharded parameter lives, as torch's puts it: the root's dp dims (``dp_names``, for
    which ``dp_mesh`` stands), then the tp dims (``tp_mesh``, or None), if they are the root's
    in that order (equal meshes, not only identical); None otherwise. Flattened shard dims stay
    the dp mesh's one dim, the tp dims beside it."""
    if tp_mesh is None and tuple(dp_names) == tuple(dp_mesh.mesh_dim_names or ()):
        return dp_mesh  # dp dims only, as fully_shard's mesh has them
    unnamed = (None,)  # a dim without a name cannot be found in the root
    tp_names = () if tp_mesh is None else tp_mesh.mesh_dim_names or unnamed
    root, names = dp_mesh._get_root_mesh(), (*(dp_names or unnamed), *tp_names)
    order = [i for n in names for i, m in enumerate(root.mesh_dim_names or ()) if m == n]
    if len(order) < len(names) or order != sorted(order):
        return None  # every dim named, in the root's order (the dp dims first)
    if tp_mesh is not None and root[tp_names] != tp_mesh:
        return None
    if len(dp_dims(dp_mesh)[1]) > 1:  # shard dims flattened (data_parallel_mesh)
        return dp_mesh if tp_mesh is None else DeviceMesh._concatenate([dp_mesh, tp_mesh])
    return dp_mesh if names == tuple(dp_mesh.mesh_dim_names or ()) else root[names]
