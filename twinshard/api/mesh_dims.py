"""``DataParallelMeshDims`` and ``ShardPlacementResult`` for torch releases before 2.13.

torch 2.13 added ``DataParallelMeshDims`` (which dims of a whole SPMD mesh are data parallel)
and ``ShardPlacementResult`` (a parameter's placement and a mesh of its own), and twinshard
re-exports torch's own classes where they exist, so that an object made from either name works
with every implementation. On torch 2.11 and 2.12 the classes here stand in with the same
fields, so twinshard still imports there (the package declares ``torch>=2.11``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """One mesh dim name, several, or none, always as a tuple of names."""
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


@dataclass
class DataParallelMeshDims:
    """The data-parallel dims of a whole SPMD mesh, by name.

    Attributes:
        shard: the dim name (or names, flattened into one) that parameters are sharded over.
        replicate: the dim name (or names) that parameters are replicated over (HSDP).
    At least one of the two must be given.
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError(
                "DataParallelMeshDims needs shard or replicate (a mesh dim name or a tuple of them)"
            )

    @property
    def shard_names(self) -> tuple[str, ...]:
        """The shard dims' names, a tuple even for one name."""
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        """The replicate dims' names, a tuple even for one name."""
        return _names(self.replicate)


@dataclass
class ShardPlacementResult:
    """A parameter's shard placement (``Shard(dim)``, or None for dim 0) and the mesh it is
    sharded over (``mesh_info``: ``mesh``, ``shard_mesh_dim``, ``replicate_mesh_dim``)."""

    placement: Any
    mesh_info: Any
