"""What every case shares: the ``Context`` it runs in, the registry, and ``train_case``.

A case takes a ``Context`` (the implementation under test, the mesh, this rank) and returns a
``Checker`` with every comparison it made. ``@case(group, needs=..., why=...)`` registers it;
where ``needs`` is false for a mesh, the case is reported as SKIP with ``why`` as the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from twinshard.ranks.devices import current_device, rank_device_type

from ..compare import Checker
from ..driver import Recipe, compare, run_oracle, run_plain, run_sharded
from ..shared_runs import fingerprint, shared


@dataclass
class Context:
    impl: object  # the implementation module under test
    impl_name: str
    oracle: object | None  # torch.distributed.fsdp, unless that is what is under test
    mesh_shape: tuple[int, ...]
    tmpdir: str
    reference: object | None = None  # twinshard.reference, unless that is what is under test
    # The runner's --device ("cpu", "cuda"); None: the device this rank was given
    # (twinshard.ranks.devices: launch's choice, else the accelerator API), never the backend's name.
    device_choice: str | None = None
    _mesh: object = None

    @property
    def world(self) -> int:
        return int(torch.tensor(self.mesh_shape).prod())

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def hsdp(self) -> bool:
        return len(self.mesh_shape) == 2

    @property
    def shard_size(self) -> int:
        return self.mesh_shape[-1]

    @property
    def device_type(self) -> str:
        return self.device_choice or rank_device_type()

    @property
    def device(self) -> torch.device:
        return current_device(self.device_type)

    @property
    def mesh(self):
        if self._mesh is None:
            kind = self.device_type
            names = ("replicate", "shard")[-len(self.mesh_shape) :]  # torch wants HSDP names
            self._mesh = init_device_mesh(kind, self.mesh_shape, mesh_dim_names=names)
        return self._mesh


@dataclass
class Case:
    name: str
    fn: Callable[[Context], Checker]
    group: str
    needs: Callable[[Context], bool] = lambda ctx: True  # where the case applies
    why: str = ""  # what ``needs`` asks for, reported when a mesh lacks it
    doc: str = ""

    def skip_reason(self, ctx: Context) -> str | None:
        """None where the case applies to ``ctx``'s mesh, else why it does not."""
        return None if self.needs(ctx) else (self.why or "does not apply to this mesh")


CASES: dict[str, Case] = {}


def case(group: str, needs=None, why: str = ""):
    """Register a case function ``case_<name>`` under ``name``."""

    def register(fn):
        name = fn.__name__.removeprefix("case_")
        CASES[name] = Case(
            name, fn, group, needs or (lambda ctx: True), why, (fn.__doc__ or "").strip()
        )
        return fn

    return register


def train_case(
    ctx: Context, recipe: Recipe, tolerance: str = "fp32", no_oracle: str | None = None
) -> Checker:
    """Truth, implementation and oracle on the same recipe, compared every step.

    ``no_oracle`` says why torch's ``fully_shard`` cannot run this case here (then it is
    compared with the truth only, and the reason goes into the report). The truth and the
    oracles' runs (and the run under test, where it is an oracle's) are shared with the other
    implementations checked on this rank (``conformance/shared_runs.py``).
    """
    checker = Checker(tolerance)
    if recipe.low_precision is not None:
        checker.low_eps = torch.finfo(recipe.low_precision).eps
    if no_oracle and ctx.oracle is not None:
        checker.notes.append(f"torch oracle skipped: {no_oracle}")
        ctx = replace(ctx, oracle=None)
    key = fingerprint(recipe)
    truth = shared(f"plain {key}", None, lambda: run_plain(recipe))
    truth_low = (
        shared(f"plain low {key}", None, lambda: run_plain(recipe, low=low, world=ctx.world))
        if (low := recipe.low_precision)
        else None
    )
    name = ctx.impl.__name__
    if name in ORACLE_MODULES:  # an oracle under test: its run is the oracle's run
        mine = oracle_run(recipe, ctx.impl, ctx.mesh)
    else:
        mine, _ = run_sharded(recipe, ctx.impl, ctx.mesh)
    compare(checker, ctx.impl_name, mine, truth, truth_low)
    if ctx.reference is not None:
        # The same reduction order gives the same bits: fp32 at world size <= 2.
        exact = recipe.low_precision is None and ctx.world <= 2
        against = Checker("bitwise" if exact else tolerance, low_eps=checker.low_eps)
        theirs = oracle_run(recipe, ctx.reference, ctx.mesh)
        compare(against, f"{ctx.impl_name} vs reference", mine, truth, truth_low, other=theirs)
        checker.absorb(against)
    if ctx.oracle is not None:
        theirs = oracle_run(recipe, ctx.oracle, ctx.mesh)
        compare(checker, "torch", theirs, truth, truth_low)
        compare(checker, f"{ctx.impl_name} vs torch", mine, truth, truth_low, other=theirs)
    return checker


ORACLE_MODULES = ("twinshard.reference", "torch.distributed.fsdp")


def oracle_run(recipe: Recipe, impl, mesh):
    """An oracle's trace of ``recipe``, shared within the case (``shared_runs``)."""
    key = f"sharded {fingerprint(recipe)}"
    return shared(key, impl.__name__, lambda: run_oracle(recipe, impl, mesh)[0])


def torch_cannot(methods: tuple[str, ...] = (), shard=None, mesh=None) -> str | None:
    """Why the installed torch's own ``fully_shard`` cannot run a case (``train_case``'s
    ``no_oracle``), or None where it can: ``methods`` its ``FSDPModule`` lacks (2.11 has no
    ``reset_iter_state``, for one), or the ``ValueError`` it raises sharding module ``shard`` on
    ``mesh`` (2.11 refuses every ``ModuleList``; 2.13 only those without forward)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    missing = [m for m in methods if not hasattr(FSDPModule, m)]
    if missing:
        return f"torch {torch.__version__} has no FSDPModule.{', .'.join(missing)}"
    try:
        if shard is not None:
            fully_shard(shard, mesh=mesh)
    except ValueError as error:
        return f"torch {torch.__version__} refuses it: {str(error).splitlines()[0]}"
    return None
