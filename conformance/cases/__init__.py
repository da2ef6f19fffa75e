"""The conformance cases. Each one trains or inspects a model through the interface only.

One module per group of cases; importing this package registers every case in ``CASES``, in
the order the suite runs them (``dcp_save`` before ``dcp_load``):

    core.py             Context, the registry (@case), train_case
    training.py         models trained and compared step by step; reshard modes
    gradients.py        accumulation, HSDP partial sums, clipping, divide factors
    mixed_precision.py  MixedPrecisionPolicy against the low-precision plain model
    api.py              offload, unshard/reshard, forward methods, parameter states, hints
    state_dict.py       state dicts, DCP across world sizes and implementations, meta init
    aliasing.py         what a user holds of a sharded parameter stays the parameter's
    errors.py           misuse and its error messages
    collective_trace.py the collectives of one step: ranks agree, dtypes, amounts
    cost.py             what each setting may communicate and keep alive, micro-batch by micro-batch
    interface.py        torch's FSDPModule type, list form, pickling, hooks, unused params
    comm_hooks.py       custom collectives, the remaining methods, recovery, mixed dtypes
    lossy.py            the communication variants, against their exact oracle and budget
    lossy_shapes.py     the shapes ZeRO++ users reported failures on, under every variant
"""

from . import (  # noqa: F401 - imported to register their cases
    aliasing,
    api,
    collective_trace,
    comm_hooks,
    cost,
    errors,
    gradients,
    interface,
    lossy,
    lossy_shapes,
    mixed_precision,
    state_dict,
    training,
)
from .core import CASES, Case, Context, case, train_case

# The import sorter decides the import order; the run order is decided here, module by module
# as listed in the docstring, each module's cases in the order they are written.
MODULES = ["training", "gradients", "mixed_precision", "api", "state_dict", "aliasing", "errors",
           "collective_trace", "cost", "interface", "comm_hooks", "lossy", "lossy_shapes"]  # fmt: skip
_ordered = sorted(CASES.items(), key=lambda kv: MODULES.index(kv[1].fn.__module__.rsplit(".")[-1]))
CASES.clear()
CASES.update(_ordered)

__all__ = ["CASES", "Case", "Context", "case", "train_case"]
