"""Putting variants on a model: one collective object per ``fully_shard``-ed module.

``attach(model, variants, mesh)`` sets, on every module of ``model`` that ``fully_shard`` made
an ``FSDPModule`` (under torch, the reference or the optimized path: the method names are the
interface), a fresh all-gather (``set_custom_all_gather``) and reduce-scatter
(``set_custom_reduce_scatter``) object for the variants that replace one, each told the module's
parameters (``segments.Layout``). It returns them by module name, so that a caller can read
what each sent (``sent_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from .bf16_wire import Bf16WireReduceScatter
from .fp8 import Fp8AllGather
from .nodes import NodeGroups
from .qgz import QuantizedReduceScatter
from .qwz import QuantizedAllGather
from .segments import Layout


@dataclass(frozen=True)
class Variant:
    """One change to FSDP's communication. ``kind``: "qwz" or "fp8" (the weights'
    all-gather), "qgz" or "bf16-wire" (the gradients' reduce-scatter); ``bits`` and ``block``
    for the block-quantized ones; ``ranks_per_node`` > 1 makes qgZ hierarchical; ``rows``
    gives fp8 a scale per matrix row rather than per tensor."""

    kind: str
    bits: int = 8
    block: int = 256
    ranks_per_node: int = 1
    rows: bool = False

    @property
    def collective(self) -> str:
        return "all_gather" if self.kind in ("qwz", "fp8") else "reduce_scatter"

    def describe(self) -> str:
        if self.kind == "bf16-wire":
            return "bf16 wire, fp32 accumulation"
        if self.kind == "fp8":
            return f"fp8 e4m3, a scale per {'row' if self.rows else 'tensor (agreed)'}"
        nodes = f", by node of {self.ranks_per_node}" if self.ranks_per_node > 1 else ""
        return f"{self.kind} int{self.bits}, blocks of {self.block}{nodes}"


KINDS = ("qwz", "qgz", "bf16-wire", "fp8")


def fsdp_modules(model: nn.Module) -> list[tuple[str, nn.Module | list[nn.Module]]]:
    """Every parameter group of ``model`` by name: a ``fully_shard``-ed module, or the list of
    modules sharded as one group (``fully_shard([norm, head])``: one state, whose collectives
    each of them sets), named by its first."""
    groups: dict = {}
    for name, m in model.named_modules():
        if hasattr(m, "set_custom_all_gather"):
            groups.setdefault(id(_group_of(m)), (name or "(root)", []))[1].append(m)
    return [(name, found if len(found) > 1 else found[0]) for name, found in groups.values()]


def _group_of(module: nn.Module):
    """The object whose hooks run for ``module``'s group: one per ``fully_shard`` call. What
    ``_get_fsdp_state()`` returns has the group's ``_pre_forward`` (torch's
    ``register_fsdp_forward_method`` calls it): torch's state itself, or twinshard's view of its
    own, made anew at each call, whose method is bound to the one state."""
    state = getattr(module, "_get_fsdp_state", lambda: module)()
    return getattr(getattr(state, "_pre_forward", None), "__self__", state)


def attach(model: nn.Module, variants: list[Variant], mesh) -> dict[str, dict]:
    """Set each variant's collective on every ``fully_shard``-ed module of ``model`` (sharded
    over ``mesh``); returns module name -> {"all_gather" | "reduce_scatter": the object}."""
    refuse_unusable(variants)
    modules = fsdp_modules(model)
    if not modules:
        raise ValueError(
            "twinshard.variants: the model has no fully_shard-ed module; shard it first"
        )
    groups = node_groups(variants, mesh)
    return {name: attach_module(module, variants, groups, name) for name, module in modules}


def refuse_unusable(variants: list[Variant]) -> None:
    """Raise ValueError, naming it, for an unknown kind or two variants on one collective."""
    for v in variants:
        if v.kind not in KINDS:
            raise ValueError(f"twinshard.variants: unknown variant {v.kind!r}; one of {KINDS}")
    clash = _clash(variants)
    if clash:
        raise ValueError(f"twinshard.variants: {clash}")


def node_groups(variants: list[Variant], mesh) -> NodeGroups | None:
    """The process groups by node that a hierarchical qgZ among ``variants`` needs on ``mesh``
    (made now, on every rank: a collective call), or None."""
    per_node = max((v.ranks_per_node for v in variants if v.kind == "qgz"), default=1)
    return NodeGroups(mesh, per_node) if per_node > 1 else None


def attach_module(module, variants: list[Variant], groups, name: str = "") -> dict:
    """Set the variants' collectives on one ``fully_shard``-ed ``module`` (or a list sharded as
    one group); ``groups``: what ``node_groups`` made for its mesh. Returns {"all_gather" |
    "reduce_scatter": the object}."""
    layout, hooks = Layout(module, name), {}
    module = module[0] if isinstance(module, (list, tuple)) else module  # the group's state
    for v in variants:
        if v.kind in ("qwz", "fp8"):
            made = Fp8AllGather(layout, v.rows) if v.kind == "fp8" else None
            hooks["all_gather"] = made or QuantizedAllGather(layout, v.bits, v.block)
            module.set_custom_all_gather(hooks["all_gather"])
        elif v.kind == "qgz":
            hooks["reduce_scatter"] = QuantizedReduceScatter(layout, v.bits, v.block, groups)
            module.set_custom_reduce_scatter(hooks["reduce_scatter"])
        else:
            hooks["reduce_scatter"] = Bf16WireReduceScatter()
            module.set_custom_reduce_scatter(hooks["reduce_scatter"])
    return hooks


def sent_bytes(hooks: dict[str, dict]) -> dict[str, int]:
    """What ``attach``'s objects sent from this rank, by collective, over every module."""
    out = {"all_gather": 0, "reduce_scatter": 0}
    for by_collective in hooks.values():
        for collective, hook in by_collective.items():
            out[collective] += hook.sent_bytes
    return out


def _clash(variants: list[Variant]) -> str | None:
    """Two variants that replace the same collective, said, or None."""
    for collective in ("all_gather", "reduce_scatter"):
        if sum(v.collective == collective for v in variants) > 1:
            return f"more than one variant replaces the {collective}"
    return None


def problem(spec: str, shard_ranks: int) -> str | None:
    """What is wrong with the ``--variants`` flag ``spec`` on a mesh sharding each parameter
    over ``shard_ranks`` ranks, or None: a spec ``parse`` refuses, two variants replacing one
    collective, or a node size that does not divide the shard ranks."""
    try:
        chosen = parse(spec)
    except ValueError as error:
        return str(error)
    clash = _clash(chosen)
    if clash:
        return f"--variants {spec}: {clash}"
    for v in chosen:
        if v.ranks_per_node > 1 and shard_ranks % v.ranks_per_node:
            return f"--variants: node={v.ranks_per_node} does not divide {shard_ranks} ranks"
    return None


def parse(spec: str) -> list[Variant]:
    """The variants a ``--variants`` flag names: kinds joined by ``+``, each with options after
    colons: ``qwz``, ``qgz:bits=4:block=128:node=8``, ``bf16-wire``, ``fp8``, ``fp8:rows``
    (``node``: ranks per node, for qgZ's two steps; ``rows``: fp8's scale per row). An empty
    spec is none."""
    out = []
    for item in filter(None, (spec or "").split("+")):
        kind, *options = item.split(":")
        fields = {}
        for option in options:
            if option == "rows" and kind == "fp8":
                fields["rows"] = True
                continue
            key, _, value = option.partition("=")
            name = {"bits": "bits", "block": "block", "node": "ranks_per_node"}.get(key)
            if name is None or not value.isdigit():
                raise ValueError(
                    f"--variants: {option!r} in {item!r} is not bits=N, block=N, node=N "
                    "(or fp8's rows)"
                )
            fields[name] = int(value)
        variant = Variant(kind, **fields)
        if kind not in KINDS:
            raise ValueError(f"--variants: unknown variant {kind!r}; one of {', '.join(KINDS)}")
        if variant.bits not in (4, 8) or variant.block < 2 or variant.block % 2:
            raise ValueError(f"--variants: {item!r}: bits=8 or 4, block an even number")
        out.append(variant)
    return out
