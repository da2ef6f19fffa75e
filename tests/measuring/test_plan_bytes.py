"""What the plan prices an operator at: the bytes it reads and writes, the same for an
operator's ``out=`` form as for its functional form (``trace.operator_bytes``)."""

import torch

from twinshard.measure.plan.trace import operator_bytes

aten = torch.ops.aten


def test_an_out_argument_counts_once_like_the_functional_result():
    a, b = torch.zeros(3, 4), torch.zeros(5, 4)
    functional = aten.cat.default
    out = torch.empty(8, 4, dtype=torch.bfloat16)
    cat_out = aten.cat.out
    result = cat_out([a, b], out=out)
    moved, tensors = operator_bytes(cat_out, ([a, b],), {"out": out}, result)
    assert moved == operator_bytes(functional, ([a, b],), {}, functional([a, b]).bfloat16())[0]
    assert moved == (12 + 20) * 4 + 32 * 2  # read fp32, written bf16
    assert [t.shape for t in tensors] == [a.shape, b.shape, out.shape]


def test_an_out_argument_of_an_operator_that_returns_nothing_counts():
    gathered = torch.zeros(4, 8)
    params = [torch.empty(4, 6), torch.empty(4, 2)]
    copy = aten.split_with_sizes_copy.out
    result = copy(gathered, [6, 2], 1, out=params)
    assert operator_bytes(copy, (gathered, [6, 2], 1), {"out": params}, result)[0] == 2 * 32 * 4


def test_an_in_place_operator_reads_and_writes_self():
    x, y = torch.zeros(10), torch.zeros(10)
    result = aten.add_.Tensor(x, y)
    assert operator_bytes(aten.add_.Tensor, (x, y), {}, result)[0] == 3 * 40
