"""The c10d collectives as the dispatcher shows them: one table, and how to read their arguments.

Every ``torch.distributed`` collective on tensors reaches a ``TorchDispatchMode`` as an operator
of the ``c10d`` namespace, whichever implementation issued it and however it wrapped the call.
``OPS`` says, for each operator that moves an FSDP step's tensors, which collective it is and
which of its schema's arguments hold the results and the inputs; the process group is the
argument ``process_group``, which reaches a mode boxed as a ``ScriptObject`` (``group_of``).

One table for everyone who watches collectives: the conformance suite's trace
(``conformance/trace.py``), the schedule recorder (``schedule/record.py``), the memory probe
(``twinshard/measure/probe.py``), the device monitor (``twinshard/measure/monitor.py``) and, through them, the plan's
step trace, and the debug guard's watch (``guard/collectives.py``), which also names a Python
function (``dist.reduce_scatter_tensor``, a custom reduce-scatter hook) by the collective it
issues (``kind``). It imports nothing of the project, so any of them may import it.

Two ranks may all-gather by exchanging their blocks of one buffer in place: an all-to-all
(twinshard's optimized path on gloo, [Note: all-gather on gloo]). Every reader counts it as the
all-gather it stands for (``gathered_in_place``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


class Op(NamedTuple):
    kind: str  # all_gather | reduce_scatter | all_reduce | broadcast | all_to_all
    outputs: str  # the schema argument holding the results
    inputs: str  # the schema argument holding the inputs (the same one for an in-place op)


OPS = {
    "_allgather_base_": Op("all_gather", "output_tensor", "input_tensor"),
    "allgather_into_tensor_coalesced_": Op("all_gather", "outputs", "inputs"),
    "_reduce_scatter_base_": Op("reduce_scatter", "output_tensor", "input_tensor"),
    "reduce_scatter_tensor_coalesced_": Op("reduce_scatter", "outputs", "inputs"),
    "allreduce_": Op("all_reduce", "tensors", "tensors"),
    "allreduce_coalesced_": Op("all_reduce", "tensors", "tensors"),
    "broadcast_": Op("broadcast", "tensors", "tensors"),
    "alltoall_base_": Op("all_to_all", "output", "input"),
}
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")


def name_of(func) -> str | None:
    """The operator's name if ``func`` is a collective of ``OPS``, else None."""
    if getattr(func, "namespace", "") != "c10d":
        return None
    name = getattr(func, "__name__", "").split(".")[0]
    return name if name in OPS else None


def kind(name) -> str:
    """The collective that ``name`` issues: an operator of ``OPS``, or any function or object
    whose name, read without underscores, contains a collective's (``reduce_scatter_tensor``,
    ``allgather_coalesced_``); a callable object by its class (its ``repr`` holds an address,
    which differs from rank to rank). Anything else keeps its own name."""
    if not isinstance(name, str):
        name = getattr(name, "__name__", type(name).__name__)
    if name in OPS:
        return OPS[name].kind
    plain = name.replace("_", "")
    return next((k for k in KINDS if k.replace("_", "") in plain), name)


def tensors(value) -> list[torch.Tensor]:
    """The tensors in ``value``: a tensor, or lists, tuples and dicts of them, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors(v)]
    return []


def arguments(func, args, kwargs) -> dict:
    """Every argument of the call by its schema's name, defaults included."""
    schema = func._schema.arguments
    bound = {a.name: a.default_value for a in schema if a.has_default_value()}
    bound.update(zip((a.name for a in schema), args))
    bound.update(kwargs or {})
    return bound


def sides(name: str, bound: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The output and input tensors of a call of operator ``name`` (``arguments``' dict)."""
    op = OPS[name]
    return tensors(bound[op.outputs]), tensors(bound[op.inputs])


def group_of(value):
    """The process group a ``ScriptObject`` argument boxes, or None (not one: a ``ReduceOp``)."""
    if not isinstance(value, torch.ScriptObject):
        return None
    try:
        return dist.ProcessGroup.unbox(value)
    except RuntimeError:
        return None


def gathered_in_place(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> int | None:
    """The elements of the all-gather that an all-to-all stands for, or None when it is not one.

    Each of two ranks sends its slot of a buffer and receives the other's slot of the same
    buffer. Such an all-to-all is recognised by its tensors alone: one output and one input
    that share their memory and together cover it exactly. Any other all-to-all stays one."""
    if len(outputs) != 1 or len(inputs) != 1:
        return None
    out, inp = outputs[0], inputs[0]
    if is_traceable_wrapper_subclass(out) or is_traceable_wrapper_subclass(inp):
        return None
    memory = out.untyped_storage()
    numel = out.numel() + inp.numel()
    if memory.nbytes() != numel * out.element_size():
        return None  # first: most all-to-alls stop here, before a pointer is read
    # the same storage, compared as objects: a FakeTensor's (a plan's) has no address to read
    shared = StorageWeakRef(memory) == StorageWeakRef(inp.untyped_storage())
    return numel if shared else None


def collective_size(name: str, found: list[torch.Tensor]) -> tuple[str, int, torch.Tensor]:
    """The collective that operator ``name`` issues on ``found`` (its tensors as the call lists
    them, output first), its elements and its largest tensor (whose dtype it runs in). The
    elements are the largest tensor's, or for an exchange in place the whole buffer it fills."""
    op, big = OPS[name].kind, max(found, key=lambda t: t.numel())
    if op == "all_to_all" and (whole := gathered_in_place(found[:1], found[1:2])):
        return "all_gather", whole, big
    return op, big.numel(), big


class Call(NamedTuple):
    """One collective as a dispatch mode sees it (``call``): what every observer reads."""

    name: str  # the operator, a key of ``OPS``
    op: str  # the collective it stands for (an exchange in place: the all-gather)
    numel: int  # of its largest tensor, or the whole buffer of an exchange in place
    big: torch.Tensor  # its largest tensor, whose dtype it runs in
    outputs: list[torch.Tensor]
    inputs: list[torch.Tensor]  # the outputs again for an operator in place
    group: object  # its process group, or None where the call names none
    blocking: bool  # the caller did not ask for a work handle

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the call, outputs first, each once."""
        return self.outputs if self.inputs is self.outputs else self.outputs + self.inputs

    @property
    def dtype(self) -> str:
        return str(self.big.dtype).removeprefix("torch.")

    @property
    def nbytes(self) -> int:
        return self.numel * self.big.element_size()

    def ranks(self) -> list[int]:
        """The global ranks of its group (all of them for none; for a group the default
        world does not know, as many as it has)."""
        if self.group is None:
            return list(range(dist.get_world_size()))
        try:
            return dist.get_process_group_ranks(self.group)
        except (ValueError, RuntimeError):
            return list(range(self.group.size()))


def call(func, args, kwargs=None) -> Call | None:
    """``func`` called on ``args`` and ``kwargs`` as a ``Call``, or None: not a collective of
    ``OPS``, or one with no tensor."""
    name = name_of(func)
    if name is None:
        return None
    bound = arguments(func, args, kwargs)
    outputs, inputs = sides(name, bound)
    if OPS[name].outputs == OPS[name].inputs:
        inputs = outputs
    found = outputs if inputs is outputs else outputs + inputs
    if not found:
        return None
    op, numel, big = collective_size(name, found)
    group = group_of(bound.get("process_group"))
    return Call(name, op, numel, big, outputs, inputs, group, not bound.get("async_op", True))


def exchanges_values(group) -> bool:
    """Whether ``group``'s collectives carry values between processes: PyTorch's fake process
    group (one process playing one rank of many) answers every collective without any."""
    try:
        backends = [group._get_backend(d) for d in group._device_types]
    except (AttributeError, RuntimeError):
        return True
    return not any(type(b).__name__ == "FakeProcessGroup" for b in backends)
