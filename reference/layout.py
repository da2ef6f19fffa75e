"""How one parameter's data meets the collectives: the plain layout, the identity case.

Sharding, gathering and reducing are the same for every parameter but at three moments, where
FSDP's features differ:

1. the all-gather's input: what this rank hands over of its shard;
2. the unsharded parameter: how it is made from the gathered buffer, and kept or freed;
3. the gradient: how autograd's gradient becomes rows this rank reduces and keeps.

A ``Layout`` owns the three moments and the fields they need. ``ShardedParam`` holds one,
chosen once when the parameter is sharded (``more.choose_layout``), and asks it at each moment;
it has no branch for any feature. The layout below is the plain one: the parameter's rows are
cut and gathered as they are, the gathered buffer's first rows are the parameter, and the
gradient is a plain tensor of the parameter's shape. Tensor parallelism, ``Shard(dim)``, CPU
offload, the all-gather extension and HSDP's partial sums are layouts of the second reading
(``more/layouts.py``): subclasses that change the moments they need, and nothing else.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .collectives import pad_rows
from .mesh import MeshInfo


class Layout:
    """The plain layout: a parameter's own rows, on the compute device, gathered and reduced
    as they are. Every method is the identity, or the one obvious step."""

    plain = True  # the shard is whole rows of a plain tensor on the compute device
    dim = 0  # the dim cut into blocks ("rows")
    non_blocking = False  # whether the copy to the compute device lets the host go on

    def __init__(self, device: torch.device, mp=None):
        self.device = device  # where compute happens
        self.shard_device = device  # where the shard lives
        self.mp = mp  # the group's MixedPrecisionPolicy (told to a shard that gathers itself)

    # --- construction ---------------------------------------------------------------------
    def piece(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor FSDP cuts into blocks: the parameter itself."""
        return param

    def rows_first(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` with the dim cut into blocks first, (rows, *rest): ``t`` itself."""
        return t

    def shard_spec(self, info: MeshInfo, stride: tuple) -> tuple:
        """Where the sharded ``DTensor`` lives: the shard group's mesh, ``Shard(0)`` on it."""
        return info.mesh, info.placements(self.dim), stride

    def kept_shard(self, block: torch.Tensor) -> torch.Tensor:
        """The memory the shard ``block`` (local_rows, *rest) is kept in: as it is."""
        return block

    # --- moment 1: the all-gather's input -------------------------------------------------
    def gather_inputs(self, p, dtype: torch.dtype) -> list[torch.Tensor]:
        """This rank's block of ``p`` (a ``ShardedParam``), on the compute device in ``dtype``,
        padded to (chunk, *rest): the one input of its all-gather."""
        local = self.rows_first(p.local_shard)  # (<= chunk, *rest)
        local = local.to(self.device, dtype, non_blocking=self.non_blocking)
        return [pad_rows(local, p.chunk).contiguous()]  # (chunk, *rest)

    # --- moment 2: the unsharded parameter ------------------------------------------------
    def gather_outputs(self, p, dtype: torch.dtype) -> list[torch.Tensor]:
        """The tensors the all-gather fills: ``p``'s buffer of (S * chunk, *rest)."""
        return [p.all_gather_output(dtype)]

    def unsharded(self, whole: torch.Tensor) -> torch.Tensor:
        """The unsharded parameter's data, made once from ``whole``, the gathered buffer's
        first rows in the parameter's layout: ``whole`` itself."""
        return whole

    def finish(self, p) -> nn.Parameter | None:
        """Once the outputs are gathered: a newly made unsharded parameter, or None (here:
        ``unsharded`` made it with the buffer)."""
        return None

    def piece_to_keep(self, p, post_forward: MeshInfo) -> torch.Tensor:
        """This rank's 1/N of the gathered buffer (S * chunk / N, *rest), kept after forward."""
        piece = p.all_gather_buffer.shape[0] // post_forward.shard_size
        start = post_forward.shard_rank * piece
        return p.all_gather_buffer[start : start + piece].clone()

    def free(self, p) -> None:
        """Free the unsharded memory: the gathered buffer's storage shrinks to nothing."""
        p.all_gather_storage.resize_(0)

    # --- moment 3: the gradient -----------------------------------------------------------
    def local_grad(self, grad: torch.Tensor, reduce_dtype: torch.dtype) -> torch.Tensor:
        """The gradient as this rank reduces it, (rows, *rest): autograd's, as it is."""
        return grad

    def grad_block(self, p, block: torch.Tensor) -> torch.Tensor:
        """A reduced block (local_rows, *rest) in the shard's layout, dtype and memory."""
        return self.rows_first(block).to(dtype=p.sharded_param.dtype)

    # --- between steps --------------------------------------------------------------------
    def settle(self, p) -> None:
        """After the module's parameter was (maybe) replaced: nothing to move."""

    def discard(self) -> None:
        """After an aborted iteration: nothing kept back."""
