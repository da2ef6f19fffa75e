"""The interface every twinshard implementation shares: policies, the FSDPModule contract, errors.

This package holds no algorithm. It is the contract of PyTorch's FSDP2 ``fully_shard`` (torch >=
2.11) written once, so that ``twinshard.reference`` and ``twinshard.optimized`` expose the same
types and a user can swap ``torch.distributed.fsdp.fully_shard`` for either one and back.

- ``MixedPrecisionPolicy``, ``OffloadPolicy``, ``CPUOffloadPolicy``: user-facing settings.
  twinshard's implementations also accept torch's own policy objects (same fields).
- ``FSDPModule`` (written in ``fsdp_module.py``, exported here): the methods that
  ``fully_shard`` adds to a module. An implementation subclasses it and fills in the abstract
  methods; the docstrings there are the specification. ``CommHooks``: the communication a user
  swapped in with ``set_custom_all_gather`` and its siblings.
- ``ShardPlacementResult``: a parameter's placement and mesh of its own, as ``shard_placement_fn``
  may answer (torch 2.13's class where it exists); ``arguments.py`` reads any answer.
- ``UnshardHandle``: what ``FSDPModule.unshard(async_op=True)`` returns.
- ``fsdp_class``, ``register_fsdp_forward_method``: a sharded module's class, and another of
  its methods run with the hooks of ``forward``; the same for every implementation.
- ``FSDPUsageError``: raised for misuse; it names the module or parameter and says what to do.

Its files:

__init__.py     the policies, the errors, ``UnshardHandle``, the helpers every implementation
                calls (this face: what a user imports from ``twinshard.api``)
fsdp_module.py  the ``FSDPModule`` contract: every method ``fully_shard`` adds, documented once
arguments.py    what ``fully_shard`` refuses, in torch's words, before it shards anything,
                and the data-parallel mesh that ``dp_mesh_dims`` names
mesh_dims.py    ``DataParallelMeshDims`` and ``ShardPlacementResult`` for torch before 2.13
comm_memory.py  where the collectives' buffers come from: torch's two switches for NCCL's memory
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

try:  # torch's own where it has one (2.13 on): the same object works with every implementation
    from torch.distributed.fsdp import DataParallelMeshDims
except ImportError:  # torch 2.11 and 2.12
    from twinshard.api.mesh_dims import DataParallelMeshDims
try:  # the same: torch's own from 2.13 on
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
except ImportError:  # pragma: no cover - torch 2.11 and 2.12
    from twinshard.api.mesh_dims import ShardPlacementResult

__all__ = [
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "FSDPModule",  # noqa: F822 - defined in twinshard/api/fsdp_module.py, see __getattr__
    "CommHooks",  # noqa: F822
    "fsdp_class",
    "register_fsdp_forward_method",
    "DataParallelMeshDims",
    "ShardPlacementResult",
    "UnshardHandle",
    "FSDPUsageError",
    "FSDPNotSupportedError",
    "as_mp_policy",
    "as_offload_policy",
]


class FSDPUsageError(ValueError, RuntimeError, AssertionError):
    """``fully_shard`` or an ``FSDPModule`` method was used in a way that cannot work.

    It derives from ``ValueError``, ``RuntimeError`` and ``AssertionError`` because torch's
    ``fully_shard`` raises one or another of them for the same misuse (an ``AssertionError``
    for a 2D mesh without dim names or a ``Shard`` dim the parameter does not have); code
    written against torch keeps catching it.
    """


class FSDPNotSupportedError(FSDPUsageError, NotImplementedError):
    """A combination that torch's FSDP2 refuses with ``NotImplementedError`` (not supported yet);
    an ``FSDPUsageError`` too."""


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Module-level mixed precision: which dtypes parameters, gradients and outputs use.

    Attributes:
        param_dtype: dtype of the unsharded parameters, hence of the all-gather and of the
            forward/backward compute. ``None`` keeps the original dtype. The sharded
            parameters (what the optimizer steps) always keep their original dtype.
        reduce_dtype: dtype of the gradient reduction (reduce-scatter, all-reduce). ``None``
            means the gradient's own dtype (``param_dtype`` when that is set).
        output_dtype: when set, floating-point forward outputs are cast to it.
        cast_forward_inputs: cast floating-point forward inputs to ``param_dtype`` before
            each sharded module's forward.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A sharded module's forward inputs, their floating-point tensors cast to
        ``param_dtype`` (when the policy casts inputs); as given otherwise."""
        if not (self.cast_forward_inputs and self.param_dtype is not None):
            return args, kwargs
        return cast_floats((args, kwargs), self.param_dtype)

    def cast_output(self, output: Any) -> Any:
        """A sharded module's forward output, its floating-point tensors cast to
        ``output_dtype`` (when set); as given otherwise."""
        return output if self.output_dtype is None else cast_floats(output, self.output_dtype)


@dataclass
class OffloadPolicy:
    """No offloading: sharded parameters and gradients stay on the compute device (default)."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, their gradients and hence the optimizer state on the CPU.

    Parameters are copied to the compute device for the all-gather; reduced gradient shards
    are copied back to the CPU, where the optimizer steps.

    Attributes:
        pin_memory: pin the CPU shards so host/device copies can be asynchronous. Only used
            when the compute device is an accelerator.
    """

    pin_memory: bool = True


def as_mp_policy(policy: Any) -> MixedPrecisionPolicy:
    """Accept twinshard's or torch's ``MixedPrecisionPolicy`` (or any object with its fields)."""
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    fields = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
    if policy is None or not all(hasattr(policy, f) for f in fields):
        raise FSDPUsageError(
            f"mp_policy must be a MixedPrecisionPolicy, got {type(policy).__name__}; "
            "pass twinshard.api.MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...)"
        )
    return MixedPrecisionPolicy(**{f: getattr(policy, f) for f in fields})


def as_offload_policy(policy: Any) -> OffloadPolicy:
    """Accept twinshard's or torch's ``OffloadPolicy``/``CPUOffloadPolicy``."""
    if isinstance(policy, OffloadPolicy):
        return policy
    name = type(policy).__name__
    if name == "CPUOffloadPolicy":
        return CPUOffloadPolicy(pin_memory=getattr(policy, "pin_memory", True))
    if name == "OffloadPolicy":
        return OffloadPolicy()
    raise FSDPUsageError(
        f"offload_policy must be OffloadPolicy() or CPUOffloadPolicy(), got {name}"
    )


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` blocks until the
    all-gathered parameters are usable. A single-stream implementation returns a handle that
    is already complete."""

    def wait(self) -> None:
        """Block until the unshard has finished (no-op when it already has)."""


def check_fsdp_modules(modules: Iterable[Any], where: str) -> list:
    """The modules of a prefetch list, checked: each must be one that fully_shard was applied
    to. ``where`` names the method in the error."""
    from twinshard.api.fsdp_module import FSDPModule

    modules = list(modules)
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise FSDPUsageError(
                f"{where} expects modules that fully_shard was applied to; "
                f"{type(m).__name__} is not one"
            )
    return modules


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside a nested structure of tuples, lists, dicts and dataclasses."""
    found: list[torch.Tensor] = []
    map_tensors(lambda t: found.append(t) or t, obj)
    return found


def map_tensors(fn, obj: Any) -> Any:
    """Apply ``fn`` to every tensor in a nested structure, rebuilding the structure."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    kind = type(obj)
    if kind is tuple or kind is list:  # the usual arguments: no namedtuple or dataclass tests
        return kind([map_tensors(fn, v) for v in obj])
    if kind is dict:
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    if isinstance(obj, dict):
        return type(obj)((k, map_tensors(fn, v)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    if hasattr(obj, "__dataclass_fields__") and not isinstance(obj, type):
        changes = {f: map_tensors(fn, getattr(obj, f)) for f in obj.__dataclass_fields__}
        try:
            return type(obj)(**changes)
        except TypeError:  # a dataclass whose fields are not all init arguments
            for f, v in changes.items():
                object.__setattr__(obj, f, v)
            return obj
    return obj


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor inside it cast to ``dtype``."""
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, value)


# One context that does nothing, shared: entering and leaving ``contextlib.nullcontext`` does
# nothing, so the same object serves every block, nested or not, without being built each time.
NOT_PROFILED = contextlib.nullcontext()


def profiled(name: str):
    """Context manager: label the work inside it ``name`` in a profiler trace. Outside a
    profiler it does nothing; ``torch.profiler.record_function`` alone costs about 5 us per
    call even then, which on small models is a measurable share of a hook."""
    if torch._C._autograd._profiler_enabled():  # the check record_function makes itself
        return torch.profiler.record_function(name)
    return NOT_PROFILED


def write_count(tensors: list) -> int:
    """How many in-place writes ``tensors`` have had between them, as autograd counts them (each
    tensor's version counter, which views share with their base). The counters only grow, so
    the count moves with any write; it is read on the host and syncs nothing."""
    return sum([t._version for t in tensors])


def without_grad(fn):
    """Decorator: run ``fn`` with gradients off, like ``@torch.no_grad()``, but switch the
    mode only when gradients are on, and switch it directly. The hooks of the optimized path
    nest several such functions; ``with torch.no_grad()`` builds three objects and makes
    several Python calls to do the same (about 19,000 instructions under valgrind, against
    about 3,000 for the two switches here)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        torch._C._set_grad_enabled(False)
        try:
            return fn(*args, **kwargs)
        finally:
            torch._C._set_grad_enabled(True)

    return run


@functools.cache
def fsdp_class(methods: type, cls: type) -> type:
    """``FSDP<Name>``: the module's own class with the FSDPModule ``methods`` mixed in.

    ``_orig_cls_mro_index`` tells torch's ``FSDPModule.__new__`` where the original class sits
    in the MRO, so that a slice of a sharded container builds the original class again."""
    index = type("probe", (methods, cls), {}).__mro__.index(cls)  # the same in the new class
    return type(f"FSDP{cls.__name__}", (methods, cls), {"_orig_cls_mro_index": index})


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` run the same hooks as ``module(...)`` does, so a
    method other than ``forward`` (e.g. ``generate``) sees unsharded parameters; for every
    implementation, through the module's ``_get_fsdp_state`` (torch's way)."""
    if not hasattr(module, "_get_fsdp_state"):  # an FSDPModule, as fully_shard makes one
        raise FSDPUsageError(
            f"register_fsdp_forward_method: fully_shard was not applied to "
            f"this {type(module).__name__}"
        )
    method = getattr(module, method_name, None)
    if not callable(method):
        raise FSDPUsageError(f"{type(module).__name__} has no method '{method_name}'")

    state = module._get_fsdp_state()  # as torch's, the implementation's hooks

    @functools.wraps(method)
    def with_hooks(*args, **kwargs):
        args, kwargs = state._pre_forward(module, args, kwargs)
        return state._post_forward(module, args, method(*args, **kwargs))

    setattr(module, method_name, with_hooks)


def __getattr__(name: str) -> Any:
    """``FSDPModule`` and ``CommHooks`` live in ``twinshard/api/fsdp_module.py`` (which uses the
    names above); they are part of this interface and load on first use."""
    if name in ("FSDPModule", "CommHooks"):
        from twinshard.api import fsdp_module

        return getattr(fsdp_module, name)
    raise AttributeError(f"module 'twinshard.api' has no attribute {name!r}")
