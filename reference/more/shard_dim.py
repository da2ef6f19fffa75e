"""Second reading. ``Shard(dim)``: a parameter cut along a dim other than its first.

``shard_placement_fn`` may return ``Shard(dim)`` for a parameter: its blocks are then cut along
``dim``, not rows. Every block and collective still sees rows: the layout views the parameter
with ``dim`` first (``rows_first``, a transpose, its own inverse), so the core cuts, pads,
gathers and reduces (rows, *rest) exactly as for ``Shard(0)``. Two things differ:

- the sharded ``DTensor`` is placed ``Shard(dim)``;
- the gathered rows, seen in the parameter's layout, are a transposed view, not contiguous. As
  torch's ``fully_shard`` does, the unsharded parameter gets memory of its own (``own``), filled
  from the gathered rows at each unshard and freed with them.
"""

from __future__ import annotations

import torch

from ..layout import Layout


class ShardDim(Layout):
    """The layout of a parameter sharded on ``Shard(dim)``, dim > 0."""

    plain = False

    def setup(self, *, param, dim: int, **_) -> None:
        self.dim = dim % param.dim()  # the dim cut into blocks
        self.own: torch.Tensor | None = None  # the unsharded parameter's contiguous memory

    def rows_first(self, t: torch.Tensor) -> torch.Tensor:
        return t.transpose(0, self.dim)  # (rows along dim, ...): its own inverse

    def unsharded(self, whole: torch.Tensor) -> torch.Tensor:
        """Memory of its own for the parameter, like ``whole`` (the gathered rows, transposed
        back) but contiguous; filled by ``finish``."""
        self.own = torch.empty_like(whole, memory_format=torch.contiguous_format)
        self.gathered, self.own_bytes = whole, self.own.untyped_storage().nbytes()
        return super().unsharded(self.own.data)  # ``.data``: see ``all_gather_output``

    def finish(self, p):
        self.own.untyped_storage().resize_(self.own_bytes)
        self.own.copy_(self.gathered)  # (rows along dim, ...) in the parameter's layout
        return super().finish(p)

    def free(self, p) -> None:
        super().free(p)
        self.own.untyped_storage().resize_(0)
