"""Which modules of a model are sharded, and which parameters each one manages.

The schedule view (``record.py``) follows every parameter group through a step. A group is a
module that ``fully_shard`` was applied to, by either twinshard implementation, a variant of
them, or torch's own; it manages its own parameters and those of its children that are not
sharded themselves. A tied parameter belongs to the lowest group that holds it.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import DTensor

from .attribute import GroupInfo


def is_fsdp_module(module: nn.Module) -> bool:
    """Sharded by twinshard (either implementation, or a variant) or by torch's fully_shard."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    from twinshard.api import FSDPModule

    return isinstance(module, (FSDPModule, TorchFSDPModule))


def find_groups(model: nn.Module) -> list[GroupInfo]:
    """Every sharded module with the parameters it manages (not those of sharded children)."""
    groups, seen = [], set()
    fsdp = [(path, m) for path, m in model.named_modules() if is_fsdp_module(m)]
    for path, module in reversed(fsdp):  # children first: a tie belongs to the lower group
        owned, todo = [], [("", module)]
        while todo:
            prefix, m = todo.pop()
            for attr, p in m.named_parameters(recurse=False):
                if isinstance(p, DTensor) and id(p) not in seen:
                    seen.add(id(p))
                    owned.append((prefix + attr, m, attr, p))
            for child_name, child in reversed(list(m.named_children())):
                if not is_fsdp_module(child):
                    todo.append((f"{prefix}{child_name}.", child))
        groups.append(GroupInfo(path, module, owned))
    return list(reversed(groups))
