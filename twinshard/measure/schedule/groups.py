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
    modules sharded by one call (``fully_shard([norm, output])``) make one group, shown as
    ``norm+output`` with its parameters' names from the model (``norm.weight``)."""
    groups, seen = [], set()
    fsdp = [(path, m) for path, m in model.named_modules() if isinstance(m, FSDPModule)]
    calls: dict = {}  # one entry per fully_shard call: the modules' paths and modules
    for path, module in fsdp:
        calls.setdefault(_call_of(module), []).append((path, module))
    for members in reversed(list(calls.values())):  # children first: a tie is the lower group's
        owned = []
        for path, module in members:
            prefix = f"{path}." if len(members) > 1 and path else ""
            owned += _owned(module, prefix, seen)
        paths = [path for path, _ in members]
        groups.append(GroupInfo("+".join(paths), members[0][1], owned, [m for _, m in members]))
    return list(reversed(groups))


def _call_of(module: nn.Module):
    """What the modules of one ``fully_shard`` call share: their state's pre-forward hook (a
    bound method, equal for one state), as torch's ``register_fsdp_forward_method`` reads it."""
    return getattr(module._get_fsdp_state(), "_pre_forward", None) or id(module)


def _owned(module: nn.Module, prefix: str, seen: set) -> list:
    """The sharded parameters ``module`` manages: (name, owner module, attribute, parameter)."""
    owned, todo = [], [(prefix, module)]
    while todo:
        at, m = todo.pop()
        for attr, p in m.named_parameters(recurse=False):
            if isinstance(p, DTensor) and id(p) not in seen:
                seen.add(id(p))
                owned.append((at + attr, m, attr, p))
        for child_name, child in reversed(list(m.named_children())):
            if not isinstance(child, FSDPModule):
                todo.append((f"{at}{child_name}.", child))
    return owned
