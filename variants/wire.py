"""What every variant's collective object shares: torch's ``Comm.allocate`` (FSDP asks the
object for the buffers it writes) and a count of the bytes this rank put on the wire, which the
tests and the cost checks read."""

from __future__ import annotations

import torch


class WireCollective:
    def __init__(self):
        self.sent_bytes = 0

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)
