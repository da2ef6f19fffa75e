"""The model fingerprint, compared across ranks at a root's first forward (always on).

``fingerprint`` describes a model in lines: each group a twinshard root found (implementation,
mesh, policies), then each parameter by full name with its shape, dtype, ``requires_grad`` and
the group that shards it (or, for any other module, its DTensor placements). ``check_model``
compares a hash of the lines across ranks and only on a mismatch exchanges the lines.
"""

from __future__ import annotations

import hashlib
import json
import time

import torch
import torch.distributed as dist

from . import channel
from .channel import PREFIX, GuardError
from .usage import mesh_ranks


def fingerprint(module: torch.nn.Module, states=()) -> list[str]:
    """The lines ranks compare: each sharded group (``states``: FSDP states of a twinshard
    root) with its implementation, mesh and policies, then each parameter by full name."""
    names = {id(m): n for n, m in module.named_modules()}
    group_of, lines = {}, []
    for state in states:
        where = "+".join(names.get(id(m), "?") or "(root)" for m in _modules_of(state))
        lines.append(f"group {where}: {type(state).__module__}, {_policies(state)}")
        for p in state.group.params if state.group is not None else ():
            group_of[id(p.sharded_param)] = f"group {where}"
    for name, p in module.named_parameters(remove_duplicate=False):
        where = group_of.get(id(p))
        if where is None:
            where = f"placements {tuple(p.placements)}" if hasattr(p, "placements") else "local"
        dtype = str(p.dtype).removeprefix("torch.")
        grad = "trainable" if p.requires_grad else "frozen"
        lines.append(f"param {name}: {tuple(p.shape)} {dtype} {grad}, {where}")
    return lines


def _modules_of(state) -> list:
    return list(getattr(state, "modules", None) or [state.module])


def _policies(state) -> str:
    group, mp = state.group, state.mp
    dtypes = [mp.param_dtype, mp.reduce_dtype, mp.output_dtype]
    text = "mp " + "/".join(str(d).removeprefix("torch.") for d in dtypes)
    text += f" cast_inputs={mp.cast_forward_inputs}"
    if group is None:
        return text + ", no parameters of its own"
    after = group.post_forward_info
    keep = "keep" if after is None else "reshard" if after is group.info else after.shard_size
    shards = sorted({p.layout.shard_device.type for p in group.params})
    return f"{text}, mesh {tuple(group.info.mesh.shape)}, after forward {keep}, shards on {shards}"


def _ranks_of(module: torch.nn.Module, states) -> tuple:
    meshes = [s.group.info.mesh for s in states if s.group is not None]
    meshes += [p.device_mesh for p in module.parameters() if hasattr(p, "device_mesh")][:1]
    if not meshes:
        return tuple(range(dist.get_world_size()))
    return tuple(sorted({r for mesh in meshes for r in mesh_ranks(mesh)}))


def check_model(module: torch.nn.Module, states=()) -> None:
    """Compare ``module``'s ``fingerprint`` across the ranks that shard it; raise
    ``GuardError`` on every rank, naming the first difference and the ranks on each side.

    Called at a twinshard root's lazy init (with its states); call it on a model sharded by
    torch's ``fully_shard`` before its first forward. Reads the debug settings too."""
    channel.refresh()
    store = channel.connection()
    if store is None:
        return
    ranks = _ranks_of(module, states)
    if len(ranks) < 2 or dist.get_rank() not in ranks:
        return
    lines = fingerprint(module, states)
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    seq = channel.seq.get(("model", ranks), 0)
    channel.seq[("model", ranks)] = seq + 1
    topic = f"{PREFIX}/model/{','.join(map(str, ranks))}/{seq}"
    # Without debug mode a late rank gets as long as a collective would give it.
    wait = channel.timeout
    if not channel.debug:
        wait = max(store.timeout.total_seconds(), wait)
    hashes, missing = channel.exchange(store, topic, ranks, digest, time.monotonic() + wait)
    label = type(module).__name__
    if missing:
        raise GuardError(
            f"twinshard guard: rank(s) {missing} did not reach the first forward of the model "
            f"({label}) within {wait:.0f} s, where rank {dist.get_rank()} compares models"
        )
    if all(h == digest for h in hashes.values()):
        return
    deadline = time.monotonic() + channel.timeout
    got, _ = channel.exchange(store, f"{topic}/lines", ranks, json.dumps(lines), deadline)
    every = {dist.get_rank(): lines, **{r: json.loads(v) for r, v in got.items()}}
    channel.fail(store, f"{topic}/lines", ranks, _difference(label, every))


def _difference(label: str, every: dict) -> str:
    """Name the first line where the ranks' fingerprints part, and who is on each side."""
    sides: dict[tuple, list] = {}
    for rank in sorted(every):
        sides.setdefault(tuple(every[rank]), []).append(rank)
    if len(sides) < 2:
        return (
            f"twinshard guard: the model ({label}) differs across ranks; ranks {list(every)} agree"
        )
    (first, mine), (second, theirs) = list(sides.items())[:2]
    i = next((k for k, (a, b) in enumerate(zip(first, second)) if a != b), None)
    i = min(len(first), len(second)) if i is None else i
    ours = first[i] if i < len(first) else "(nothing more)"
    other = second[i] if i < len(second) else "(nothing more)"
    return (
        f"twinshard guard: the model ({label}) differs across ranks; first difference "
        f"(line {i + 1} of its fingerprint):\n  rank(s) {mine}: {ours}\n  rank(s) {theirs}: "
        f"{other}\nEvery rank must build the same model and shard it the same way (the same "
        "fully_shard calls and policies), or the collectives of FSDP cannot match."
    )
