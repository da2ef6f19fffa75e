"""Which modules of a model are sharded, and which parameters each one manages.

The schedule view (``record.py``) follows every parameter group through a step. A group is a module
that ``fully_shard`` was applied to, by either twinshard implementation, a variant of them, or
torch's own (twinshard's ``FSDPModule`` is a subclass of torch's); it manages its own parameters and
those of its children that are not sharded themselves. A tied parameter belongs to the lowest group
that holds it.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from .attribute import GroupInfo


def find_groups(model: nn.Module) -> list[GroupInfo]:
    """Every sharded module with the parameters it manages (not those of sharded children)."""
    groups, seen = [], set()
    fsdp = [(path, m) for path, m in model.named_modules() if isinstance(m, FSDPModule)]
    for path, module in reversed(fsdp):  # children first: a tie belongs to the lower group
        owned, todo = [], [("", module)]
        while todo:
            prefix, m = todo.pop()
            for attr, p in m.named_parameters(recurse=False):
                if isinstance(p, DTensor) and id(p) not in seen:
                    seen.add(id(p))
                    owned.append((prefix + attr, m, attr, p))
            for child_name, child in reversed(list(m.named_children())):
                if not isinstance(child, FSDPModule):
                    todo.append((f"{prefix}{child_name}.", child))
        groups.append(GroupInfo(path, module, owned))
    return list(reversed(groups))
