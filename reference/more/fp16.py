"""Second reading. The mean of fp16 gradients, divided around their sum so that it cannot overflow.

A gradient is reduced as a sum over the ranks and divided into the mean (or by the factor
``set_gradient_divide_factor`` gave). In fp32 and bf16 the sum cannot overflow where the mean
would not, so it is divided once, after. fp16 has a narrow range: the sum of N gradients can
overflow where each gradient and the mean fit. So, as torch's ``fully_shard`` does, each
gradient is first divided by the least power of two whose square reaches the factor (exact in
floating point), and the sum by the rest.
"""

from __future__ import annotations


def fp16_divisors(factor: float) -> tuple[float, float]:
    """(divisor before the sum, divisor after it) for a mean over ``factor`` in fp16."""
    before = 1
    while before * before < factor:
        before *= 2
    return float(before), factor / before
