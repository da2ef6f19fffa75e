"""Variants for code that calls ``fully_shard`` itself: trainers, through the switch.

accelerate, Lightning, the HF Trainer and torchtitan shard the model in their own code, so
there is no moment at which a user could call ``attach`` on the sharded model. The switch
(``twinshard.switch.use(impl, variants=...)``, ``TWINSHARD_VARIANTS``, ``python -m
twinshard.run --variants``) instead rebinds torch's ``fully_shard`` to ``attaching(impl's
fully_shard, variants)``: every call shards as the implementation does and then sets the
variants' collectives on the module it sharded (a list sharded as one group: on the group, its
parameters in the list's order), exactly as ``attach`` would have. Calls come bottom-up, so
each module's ``Layout`` sees its own parameters only, as ``attach`` sees them.

The process groups by node that a hierarchical qgZ needs are made at the first ``fully_shard``
over each mesh (every rank shards the same modules in the same order, so ``new_group`` is
called alike on all of them) and shared by every module on that mesh. The objects set are kept
in the wrapper's ``hooks`` (module class and call index -> the objects), to read what they sent.
"""

from __future__ import annotations

import functools

import torch.nn as nn

from .attach import Variant, attach_module, node_groups, refuse_unusable


def mesh_of(module: nn.Module, kwargs: dict):
    """The mesh a ``fully_shard`` call sharded ``module`` over: its ``mesh`` argument, else
    that of its parameters (the default mesh when the caller passed none)."""
    if kwargs.get("mesh") is not None:
        return kwargs["mesh"]
    return next((p.device_mesh for p in module.parameters() if hasattr(p, "device_mesh")), None)


def attaching(fully_shard, variants: list[Variant]):
    """``fully_shard`` that also sets ``variants`` on each module it shards (module docstring)."""
    refuse_unusable(variants)
    groups_by_mesh: dict = {}

    @functools.wraps(fully_shard)
    def fully_shard_with_variants(module, *args, **kwargs):
        sharded = fully_shard(module, *args, **kwargs)
        group = list(module) if isinstance(module, (list, tuple)) else sharded  # one group
        first = group[0] if isinstance(group, list) else group
        mesh = mesh_of(first, kwargs)
        key = None if mesh is None else (tuple(mesh.mesh.flatten().tolist()), mesh.mesh.shape)
        if key not in groups_by_mesh:
            groups_by_mesh[key] = None if mesh is None else node_groups(variants, mesh)
        name = f"{type(first).__name__}#{len(fully_shard_with_variants.hooks)}"
        hooks = attach_module(group, variants, groups_by_mesh[key], name)
        fully_shard_with_variants.hooks[name] = hooks
        return sharded

    fully_shard_with_variants.hooks = {}
    fully_shard_with_variants.variants = list(variants)
    return fully_shard_with_variants
