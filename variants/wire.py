"""What every variant's collective object shares: torch's ``Comm.allocate`` (FSDP asks the
object for the buffers it writes) and a count of the bytes this rank put on the wire, which the
tests and the cost checks read."""

from __future__ import annotations

import torch
import torch.distributed as dist

all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # 2.13 renamed it


class WireCollective:
    def __init__(self):
        self.sent_bytes = 0

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def gathers_kept(self, layout, output_tensor, input_tensor, group) -> bool:
        """hpZ's backward gather (a group smaller than the mesh's shard group ``layout`` was
        made for): forward's dequantized values gathered as they are, within the node. Returns
        whether it was one (and is done)."""
        if not layout.mesh_ranks or dist.get_world_size(group) >= layout.mesh_ranks:
            return False
        all_gather(output_tensor.view(-1), input_tensor.reshape(-1), group=group)
        self.sent_bytes += input_tensor.numel() * input_tensor.element_size()
        return True
