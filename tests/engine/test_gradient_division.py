"""Gradients in fp16 are divided before and after their sum, so that a sum over ranks cannot
overflow where the mean does not (issue 23, hazard 6), with the same numbers as torch's
``fully_shard``; fp32 and bf16 are summed first and divided once.

Four gloo ranks each compute a gradient of 20000 for every element of an fp16 weight (the
largest fp16 is 65504): their sum, 80000, overflows; their mean is 20000. The division that
decides it is ``ParamGroup.gradient_divisors``, shared by both implementations.
"""

import pytest
import torch

from twinshard.ranks.launch import launch

IMPLS = ("twinshard.reference", "twinshard.optimized", "torch.distributed.fsdp")


class Scale(torch.nn.Module):
    """``(w * x).sum()``: the gradient of every element of ``w`` is ``x``."""

    def __init__(self, rows: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(rows, 3))

    def forward(self, x):
        return (self.w * x).sum()


def _reduced_grads(cases: list) -> dict:
    """Per (dtype name, gradient value) and implementation: this rank's reduced gradient."""
    import importlib

    out = {}
    for dtype_name, value in cases:
        dtype = getattr(torch, dtype_name)
        for name in IMPLS:
            impl = importlib.import_module(name)
            model = Scale(8)
            policy = impl.MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
            impl.fully_shard(model, mp_policy=policy)
            model(torch.full((8, 3), value)).backward()
            out[dtype_name, name] = model.w.grad.to_local().float()
    return out


CASES = [("float16", 20000.0), ("bfloat16", 3.0), ("float32", 3.0)]
_results: list = []


def results() -> list:
    """Every rank's gradients, from one launch of four ranks shared by the tests below."""
    if not _results:
        _results.extend(launch(_reduced_grads, 4, CASES))
    return _results


def test_fp16_mean_of_four_large_gradients_does_not_overflow():
    for grads in results():
        for name in IMPLS:
            grad = grads["float16", name]
            assert torch.isfinite(grad).all(), f"{name}: {grad}"
            assert torch.equal(grad, torch.full_like(grad, 20000.0)), f"{name}: {grad}"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_wide_dtypes_are_divided_once_after_the_sum(dtype):
    for grads in results():
        torch_grad = grads[dtype, "torch.distributed.fsdp"]
        for name in IMPLS:
            grad = grads[dtype, name]
            assert torch.equal(grad, torch.full_like(grad, 3.0)), f"{name}: {grad}"
            assert torch.equal(grad, torch_grad), name


def test_divisors_split_a_power_of_two_before_the_sum():
    from twinshard.reference.param_group import ParamGroup

    class Info:
        shard_size, replicate_size = 4, 2

    group = ParamGroup.__new__(ParamGroup)
    group.info, group.divide_factor = Info(), None
    assert group.gradient_divisors(torch.float32, group.info) == (None, 8)
    assert group.gradient_divisors(torch.bfloat16, group.info) == (None, 8)
    assert group.gradient_divisors(torch.float16, group.info) == (4.0, 2.0)  # 4 * 4 >= 8 > 2 * 2
    group.divide_factor = 6.0
    before, after = group.gradient_divisors(torch.float16, group.info)
    assert (before, before * after) == (4.0, 6.0)
