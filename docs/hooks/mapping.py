"""torch's FSDP interface against twinshard's, found by introspection at build time.

Rows: every name in ``torch.distributed.fsdp.__all__`` and every public method that
``torch.distributed.fsdp.FSDPModule`` adds to ``nn.Module``, for the torch that builds the site.
For each row and each implementation the status is computed, never written by hand:

- **same**: the name exists, with the same parameters (names, kinds, defaults; type annotations
  are not compared) and, for a class, the same constructor and public methods;
- **differs**: it exists, but a parameter, default or method differs (the cell says which), or
  it is a class that torch's ``isinstance`` checks would not recognize where that matters;
- **missing**: twinshard has no such name.

``NOTES`` adds what introspection cannot see (behaviour). ``tests/docs/test_docs.py`` checks that
each note is attached to a row that exists and to a name each implementation it speaks of
has, so that a note outlives neither the torch name nor twinshard's.
"""

from __future__ import annotations

import importlib
import inspect

IMPLS = ("twinshard.reference", "twinshard.optimized")

# (name, implementation or None for both) -> what a user should know beyond the signature.
NOTES: dict[tuple[str, str | None], str] = {
    ("fully_shard", None): "also takes a list of modules (one group); `shard_placement_fn` may "
    "return `Shard(dim)`, None or `ShardPlacementResult` (a mesh of the parameter's own, as "
    "experts get theirs: one group, each parameter's collectives on its own mesh); "
    "tensor-parallel DTensor parameters are sharded over a 1-D dp mesh (FSDP + TP); "
    "`dp_mesh_dims` flattens several dims of a kind and takes replicate dims alone (DDP); an int "
    "`reshard_after_forward` keeps 1/N of the parameters on the call's mesh only (those on a "
    "mesh of their own reshard fully)",
    ("FSDPModule", None): "a sharded module is an instance of `twinshard.api.FSDPModule` and of "
    "torch's `FSDPModule`",
    ("MixedPrecisionPolicy", None): "twinshard's own dataclass; torch's policy objects are "
    "accepted too",
    (
        "CPUOffloadPolicy",
        None,
    ): "twinshard's own dataclass; torch's policy objects are accepted too",
    ("OffloadPolicy", None): "twinshard's own dataclass; torch's policy objects are accepted too",
    ("DataParallelMeshDims", None): "torch's own class, re-exported",
    (
        "share_comm_ctx",
        "twinshard.reference",
    ): "checks the modules; one stream, no context to share",
    ("FSDPModule.unshard", "twinshard.reference"): "blocking: with `async_op=True` the handle "
    "returned is already complete",
    ("FSDPModule.set_modules_to_forward_prefetch", "twinshard.reference"): "the list is checked "
    "and otherwise ignored: one stream, nothing to overlap",
    ("FSDPModule.set_modules_to_backward_prefetch", "twinshard.reference"): "the list is checked "
    "and otherwise ignored: one stream, nothing to overlap",
    ("FSDPModule.set_post_optim_event", "twinshard.reference"): "ignored: one stream, nothing to "
    "overlap",
    ("FSDPModule.set_custom_all_gather", "twinshard.reference"): "called once per parameter",
    ("FSDPModule.set_custom_all_gather", "twinshard.optimized"): "called once per group, on its "
    "flat buffer",
    ("FSDPModule.set_custom_reduce_scatter", "twinshard.reference"): "called once per parameter",
    ("FSDPModule.set_custom_reduce_scatter", "twinshard.optimized"): "called once per group (per "
    "reduce dtype), on its flat buffer",
    ("FSDPModule.set_all_reduce_hook", "twinshard.reference"): "called once per parameter, before "
    "the division by the world size",
    ("FSDPModule.set_all_reduce_hook", "twinshard.optimized"): "called once per group on its flat "
    "reduced buffer: the mean where the collectives take it (ReduceOp.AVG, as torch's), else "
    "the sum, before the division",
    ("FSDPModule.set_reduce_scatter_unused_params", None): "without it, twinshard names the "
    "parameters used on some ranks only at the next optimizer step or forward, tallied over the "
    "store, after giving every rank their exact gradients (at the end of the backward with "
    "TWINSHARD_DEBUG=1; torch aborts inside the backend)",
    ("FSDPModule.set_separate_reduce_scatter_group", "twinshard.reference"): "accepted; one stream",
    ("FSDPModule.set_symm_mem_for_comm", "twinshard.reference"): "checked and accepted",
    ("FSDPModule.set_symm_mem_for_comm", "twinshard.optimized"): "buffers from the symmetric-"
    "memory pool on NCCL and CUDA; elsewhere one warning, no effect",
    (
        "FSDPModule.set_allocate_memory_from_process_group_for_comm",
        "twinshard.reference",
    ): "checked and accepted",
    (
        "FSDPModule.set_allocate_memory_from_process_group_for_comm",
        "twinshard.optimized",
    ): "buffers from the backend where it allocates (NCCL); elsewhere one warning, no effect",
    ("FSDPModule.set_reduce_scatter_max_input_buffers", "twinshard.reference"): "checked (>= 1); "
    "the reductions block",
    ("FSDPModule.set_reduce_scatter_max_input_buffers", "twinshard.optimized"): "keeps up to that "
    "many reductions in flight; the compute stream waits for each that many groups later",
    ("FSDPModule.set_force_sum_reduction_for_comms", None): "the optimized path reduces with "
    "SUM and divides afterwards, instead of ReduceOp.AVG; the reference always does",
}


def torch_fsdp():
    return importlib.import_module("torch.distributed.fsdp")


def is_fsdp1(obj) -> bool:
    """FSDP1 (the ``FullyShardedDataParallel`` wrapper and its configs) lives in torch's
    ``fsdp.api`` and ``fsdp.fully_sharded_data_parallel`` modules; FSDP2 names report the
    package itself (or its private ``_fully_shard`` modules) as their module."""
    module = getattr(obj, "__module__", "") or ""
    return not (
        module == "torch.distributed.fsdp"
        or module.startswith("torch.distributed.fsdp._fully_shard")
    )


def module_methods() -> list[str]:
    """Public methods that torch's FSDPModule adds to nn.Module."""
    import torch.nn as nn

    cls = torch_fsdp().FSDPModule
    return sorted(
        n
        for n in dir(cls)
        if not n.startswith("_") and not hasattr(nn.Module, n) and callable(getattr(cls, n))
    )


def rows() -> list[tuple[str, bool]]:
    """(name, is FSDP1) for every row: the package's names, then ``FSDPModule.<method>``."""
    fsdp = torch_fsdp()
    names = [(n, is_fsdp1(getattr(fsdp, n))) for n in fsdp.__all__]
    return names + [(f"FSDPModule.{m}", False) for m in module_methods()]


def lookup(root, dotted: str):
    for part in dotted.split("."):
        root = getattr(root, part, None)
        if root is None:
            return None
    return root


def _params(fn) -> dict[str, tuple[str, str]] | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    return {
        name: (p.kind.description, "" if p.default is p.empty else repr(p.default))
        for name, p in sig.parameters.items()
        if name not in ("self", "args", "kwargs")
    }


def compare_callables(theirs, ours) -> list[str]:
    """What differs between two signatures, in words (empty: the same)."""
    t, o = _params(theirs), _params(ours)
    if t is None or o is None:
        return []
    out = []
    for name, (kind, default) in t.items():
        if name not in o:
            out.append(f"no `{name}`")
        elif o[name][0] != kind:
            out.append(f"`{name}` is {o[name][0]}, torch: {kind}")
        elif o[name][1] != default:
            out.append(
                f"`{name}` defaults to `{o[name][1] or 'nothing'}`, torch: `{default or 'nothing'}`"
            )
    extra = [n for n in o if n not in t]
    if extra:
        out.append("also takes " + ", ".join(f"`{n}`" for n in extra))
    return out


def _public_methods(cls) -> set[str]:
    return {n for n, v in vars(cls).items() if not n.startswith("_") and callable(v)}


def compare(name: str, theirs, ours) -> tuple[str, list[str]]:
    """(status, details) of ``ours`` against torch's ``theirs``."""
    if ours is None:
        return "missing", []
    if inspect.isclass(theirs) != inspect.isclass(ours):
        return "differs", ["a class in torch" if inspect.isclass(theirs) else "a function in torch"]
    details = compare_callables(theirs, ours)
    if inspect.isclass(theirs):
        if name == "FSDPModule" and not issubclass(ours, theirs):
            details.append(
                "`isinstance(m, torch.distributed.fsdp.FSDPModule)` is False for a twinshard module"
            )
        elif name != "FSDPModule":  # FSDPModule's methods have rows of their own
            lacking = sorted(m for m in _public_methods(theirs) if not hasattr(ours, m))
            details += [f"no method `{m}`" for m in lacking]
    status = "differs" if any(not d.startswith("also takes") for d in details) else "same"
    return status, details


def table() -> list[dict]:
    """One dict per row: name, fsdp1, and per implementation its status and details."""
    fsdp = torch_fsdp()
    impls = {name: importlib.import_module(name) for name in IMPLS}
    out = []
    for name, fsdp1 in rows():
        row = {"name": name, "fsdp1": fsdp1, "impls": {}}
        theirs = lookup(fsdp, name)
        for impl_name, impl in impls.items():
            status, details = compare(name, theirs, lookup(impl, name))
            note = NOTES.get((name, impl_name)) or NOTES.get((name, None))
            if note and status != "missing":
                details = [*details, note]
            row["impls"][impl_name] = (status, details)
        out.append(row)
    return out


def _cell(status: str, details: list[str]) -> str:
    text = f"**{status}**" + (": " + "; ".join(details) if details else "")
    return text.replace("|", "\\|")


def markdown() -> str:
    import torch

    rows_ = table()
    head = [
        "| torch.distributed.fsdp | " + " | ".join(f"`{i}`" for i in IMPLS) + " |",
        "| --- |" + " --- |" * len(IMPLS),
    ]

    def section(selected):
        return "\n".join(
            head
            + [
                f"| `{r['name']}` | " + " | ".join(_cell(*r["impls"][i]) for i in IMPLS) + " |"
                for r in selected
            ]
        )

    counts = {
        i: {
            s: sum(r["impls"][i][0] == s for r in rows_ if not r["fsdp1"])
            for s in ("same", "differs", "missing")
        }
        for i in IMPLS
    }
    summary = "; ".join(
        f"`{i}`: " + ", ".join(f"{n} {s}" for s, n in c.items()) for i, c in counts.items()
    )
    return "\n\n".join(
        [
            f"Generated with torch {torch.__version__} when this site was built. "
            f"FSDP2 names and methods: {summary}.",
            "### FSDP2: `fully_shard` and `FSDPModule`",
            section([r for r in rows_ if not r["fsdp1"]]),
            "### FSDP1: the `FullyShardedDataParallel` wrapper",
            "twinshard implements FSDP2 only; these names belong to torch's older wrapper API. "
            "Its `summon_full_params` is offered for any FSDP2 module, torch's included, as "
            "`twinshard.summon.summon_full_params`.",
            section([r for r in rows_ if r["fsdp1"]]),
        ]
    )
