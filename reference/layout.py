"""How one parameter's data meets the collectives: the plain layout, the identity case.

Sharding, gathering and reducing are the same for every parameter but at three moments, where
FSDP's features differ: (1) the all-gather's input, what this rank hands over of its shard;
(2) the unsharded parameter, made from the gathered buffer, kept or freed; (3) the gradient,
turned into rows this rank reduces and keeps. ``ShardedParam`` holds a ``Layout``, chosen once
when the parameter is sharded, and asks it at each moment: it has no branch for any feature.

The plain layout below cuts and gathers the parameter's rows as they are: the gathered
buffer's first rows are the parameter, and the gradient is a plain tensor of its shape. Tensor
parallelism, ``Shard(dim)``, offload, the all-gather extension and HSDP's partial sums are
subclasses in the second reading (``more/layouts.py``) that change what they must.
"""

from __future__ import annotations

import torch


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """Append zero rows so ``tensor`` has ``rows`` rows (no copy when it already has)."""
    missing = rows - tensor.shape[0]
    if missing == 0:
        return tensor
    zeros = tensor.new_zeros((missing, *tensor.shape[1:]))  # (missing, *rest)
    return torch.cat([tensor, zeros], dim=0)  # (rows, *rest)


class Layout:
    """The plain layout: every method is the identity, or the one obvious step."""

    plain = True  # the shard is whole rows of a plain tensor on the compute device
    dim = 0  # the dim cut into blocks ("rows")
    non_blocking = False  # whether the copy to the compute device lets the host go on

    def __init__(self, device: torch.device, mp=None):
        self.device = self.shard_device = device  # where compute happens; the shard lives
        self.mp = mp  # the group's MixedPrecisionPolicy (told to a shard that gathers itself)

    # --- construction: what is cut, and where the shard lives ------------------------------
    def piece(self, param: torch.Tensor) -> torch.Tensor:
        return param  # the tensor cut into blocks

    def rows_first(self, t: torch.Tensor) -> torch.Tensor:
        return t  # (rows, *rest): the dim cut into blocks comes first

    def shard_spec(self, info, stride: tuple) -> tuple:
        return info.mesh, info.placements(self.dim), stride  # the sharded DTensor's

    def kept_shard(self, block: torch.Tensor) -> torch.Tensor:
        return block  # the memory the shard (local_rows, *rest) is kept in

    # --- (1) the all-gather's input ---------------------------------------------------------
    def gather_inputs(self, p, dtype: torch.dtype) -> list[torch.Tensor]:
        """This rank's block of ``p`` (a ``ShardedParam``), on the compute device in ``dtype``,
        padded to (chunk, *rest)."""
        local = self.rows_first(p.local_shard)  # (<= chunk, *rest)
        local = local.to(self.device, dtype, non_blocking=self.non_blocking)
        return [pad_rows(local, p.chunk).contiguous()]  # (chunk, *rest)

    # --- (2) the unsharded parameter --------------------------------------------------------
    def gather_outputs(self, p, dtype: torch.dtype) -> list[torch.Tensor]:
        return [p.all_gather_output(dtype)]  # what the all-gather fills: (S * chunk, *rest)

    def unsharded(self, whole: torch.Tensor) -> torch.Tensor:
        return whole  # the parameter's data: the gathered rows, in its own layout

    def finish(self, p):
        return None  # a parameter made only now (None: ``unsharded`` made it)

    def piece_to_keep(self, p, post_forward) -> torch.Tensor:
        """This rank's 1/N of the gathered buffer (S * chunk / N, *rest), kept after forward."""
        piece = p.all_gather_buffer.shape[0] // post_forward.shard_size
        start = post_forward.shard_rank * piece
        return p.all_gather_buffer[start : start + piece].clone()

    def free(self, p) -> None:
        p.all_gather_storage.resize_(0)  # the gathered buffer's memory, kept as an object

    # --- (3) the gradient -------------------------------------------------------------------
    def local_grad(self, grad: torch.Tensor, reduce_dtype: torch.dtype) -> torch.Tensor:
        return grad  # (rows, *rest), as this rank reduces it

    def grad_block(self, p, block: torch.Tensor) -> torch.Tensor:
        return self.rows_first(block).to(dtype=p.sharded_param.dtype)  # as the shard

    # --- between steps: after a replaced parameter (nothing to move), an aborted iteration --
    def settle(self, p) -> None: ...

    def discard(self) -> None: ...
