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
    """Every sharded module with the parameters it manages (not those of sharded children);
    the modules of one call (``fully_shard([norm, output])``, one state, whose pre-forward hook
    torch's ``register_fsdp_forward_method`` reads) make one group, ``norm+output``, its
    parameters named from the model (``norm.weight``)."""
    groups, seen, calls = [], set(), {}
    for path, m in model.named_modules():
        if isinstance(m, FSDPModule):
            key = getattr(m._get_fsdp_state(), "_pre_forward", None) or id(m)
            calls.setdefault(key, []).append((path, m))
    for members in reversed(list(calls.values())):  # children first: a tie is the lower group's
        owned = []
        todo = [(f"{path}." if len(members) > 1 and path else "", m) for path, m in members]
        while todo:
            prefix, m = todo.pop(0)
            for attr, p in m.named_parameters(recurse=False):
                if isinstance(p, DTensor) and id(p) not in seen:
                    seen.add(id(p))
                    owned.append((prefix + attr, m, attr, p))
            for child_name, child in reversed(list(m.named_children())):
                if not isinstance(child, FSDPModule):
                    todo.insert(0, (f"{prefix}{child_name}.", child))
        groups.append(GroupInfo("+".join(p for p, _ in members), [m for _, m in members], owned))
    return list(reversed(groups))
