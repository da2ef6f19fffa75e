"""The conformance cases. Each one trains or inspects a model through the interface only.

One module per group of cases; importing this package registers every case in ``CASES``, in
the order the suite runs them (``dcp_save`` before ``dcp_load``):

    core.py             Context, the registry (@case), train_case
    training.py         models trained and compared step by step; reshard modes
    gradients.py        accumulation, HSDP partial sums, clipping, divide factors
    mixed_precision.py  MixedPrecisionPolicy against the low-precision plain model
    api.py              offload, unshard/reshard, forward methods, parameter states, hints
    state_dict.py       state dicts, DCP across world sizes and implementations, meta init
    errors.py           misuse and its error messages
    collective_trace.py the collectives of one step: ranks agree, dtypes, amounts
"""

from . import (  # noqa: F401 - imported to register their cases, in this order
    api,
    collective_trace,
    errors,
    gradients,
    mixed_precision,
    state_dict,
    training,
)
from .core import CASES, Case, Context, case, train_case

__all__ = ["CASES", "Case", "Context", "case", "train_case"]
