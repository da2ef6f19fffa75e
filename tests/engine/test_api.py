import dataclasses
from collections import namedtuple

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp

import twinshard.reference as reference
from twinshard import api


def test_policies_accept_torch_policies():
    theirs = torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mine = api.as_mp_policy(theirs)
    assert mine == api.MixedPrecisionPolicy(torch.bfloat16, torch.float32, None, True)
    assert isinstance(
        api.as_offload_policy(torch_fsdp.CPUOffloadPolicy(pin_memory=False)), api.CPUOffloadPolicy
    )
    assert type(api.as_offload_policy(torch_fsdp.OffloadPolicy())) is api.OffloadPolicy


def test_bad_policies_name_the_argument():
    with pytest.raises(api.FSDPUsageError, match="mp_policy"):
        api.as_mp_policy("bf16")
    with pytest.raises(api.FSDPUsageError, match="offload_policy"):
        api.as_offload_policy(3)


def test_usage_error_is_both_value_and_runtime_error():
    assert issubclass(api.FSDPUsageError, ValueError)
    assert issubclass(api.FSDPUsageError, RuntimeError)


def test_map_tensors_rebuilds_nested_structures():
    @dataclasses.dataclass
    class Out:
        a: torch.Tensor
        b: list

    Pair = namedtuple("Pair", "x y")
    value = {"d": Out(torch.ones(2), [torch.zeros(1), 3]), "p": Pair(torch.ones(1), "s")}
    doubled = api.map_tensors(lambda t: t + 1, value)
    assert torch.equal(doubled["d"].a, torch.full((2,), 2.0))
    assert torch.equal(doubled["d"].b[0], torch.ones(1)) and doubled["d"].b[1] == 3
    assert isinstance(doubled["p"], Pair) and doubled["p"].y == "s"
    assert len(api.tensors_in(value)) == 3


def test_reference_exports_the_interface():
    for name in (
        "fully_shard",
        "FSDPModule",
        "MixedPrecisionPolicy",
        "OffloadPolicy",
        "CPUOffloadPolicy",
        "UnshardHandle",
        "register_fsdp_forward_method",
    ):
        assert hasattr(reference, name), name
    assert issubclass(reference.FSDPModule, api.FSDPModule)


def test_fully_shard_without_process_group_is_a_clear_error():
    with pytest.raises(api.FSDPUsageError, match="init_process_group"):
        reference.fully_shard(torch.nn.Linear(2, 2))


def test_without_grad_turns_gradients_off_only_where_they_are_on():
    seen = []

    @api.without_grad
    def inner(x):
        seen.append(torch.is_grad_enabled())
        return x * 2

    x = torch.ones(2, requires_grad=True)
    assert not inner(x).requires_grad  # called with gradients on: runs without them
    assert torch.is_grad_enabled()  # and leaves them on afterwards
    with torch.no_grad():
        assert not inner(x).requires_grad
    assert seen == [False, False]
    assert inner.__name__ == "inner"
