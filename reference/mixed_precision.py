"""Mixed precision at module boundaries: the casts ``MixedPrecisionPolicy`` asks for.

Three dtypes are in play. The sharded parameters keep their original dtype (fp32, say): the
optimizer steps them. The unsharded parameters are all-gathered in ``param_dtype`` (bf16,
say), so forward and backward compute in it, and a module's floating-point inputs are cast to
it on the way in. Gradients are reduced in ``reduce_dtype`` (often fp32, for accurate sums)
and land in the original dtype. Outputs are cast to ``output_dtype`` when that is set.

Casts happen only where a sharded module begins or ends, never inside it: unlike autocast,
the activations saved for backward are in the low precision.
"""

from __future__ import annotations

from typing import Any

import torch

from twinshard.api import MixedPrecisionPolicy, map_tensors


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, value)


def cast_inputs(mp: MixedPrecisionPolicy, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Cast floating-point forward inputs to ``param_dtype`` (if the policy says so)."""
    if not (mp.cast_forward_inputs and mp.param_dtype is not None):
        return args, kwargs
    return _cast_floats(args, mp.param_dtype), _cast_floats(kwargs, mp.param_dtype)


def cast_output(mp: MixedPrecisionPolicy, output: Any) -> Any:
    """Cast floating-point forward outputs to ``output_dtype`` (if set)."""
    return output if mp.output_dtype is None else _cast_floats(output, mp.output_dtype)
