"""Planted lossy bugs (``conformance/planted/lossy.py``): each broken variant, run under the
optimized path at two ranks, must miss the exact oracle of the variant it claims to be, while
the correct variant meets it (``tests/variants/test_variants.py``)."""

from __future__ import annotations

import pytest
import torch
from test_variants import BLOCK, _oracle, _run_one

from twinshard.conformance.planted.lossy import PLANTED
from twinshard.ranks.launch import launch
from twinshard.variants import Variant

CLAIMS = {name: "qgz" if "dividing" in name else "qwz" for name in PLANTED}


def _run() -> dict:
    out = {}
    for name, cls in PLANTED.items():
        try:
            out[name] = _run_one("twinshard.optimized", [], planted=cls)
        except Exception as error:  # noqa: BLE001 - a crash is reported, not a catch
            out[name] = {"error": f"{type(error).__name__}: {error}"}
    return out


_results: list = []


def results() -> list[dict]:
    if not _results:
        _results.extend(launch(_run, 2))
    return _results


def _misses(outcome: dict, oracle: dict, rank: int) -> list[str]:
    """What of ``outcome`` is off the oracle by more than fp32's tolerances."""
    misses = []
    want = torch.tensor([step[rank] for step in oracle["losses"]])
    if not torch.allclose(torch.tensor(outcome["losses"]), want, rtol=1.3e-6, atol=1e-5):
        misses.append("losses")
    for n, shard in outcome["shards"].items():
        rows = -(-oracle["params"][n].shape[0] // 2)
        expected = oracle["params"][n][rank * rows : (rank + 1) * rows]
        if not torch.allclose(shard, expected, rtol=1.3e-6, atol=1e-5):
            misses.append(n)
    return misses


@pytest.mark.parametrize("name", list(PLANTED))
def test_each_planted_lossy_bug_misses_the_oracle_of_what_it_claims(name):
    oracle = _oracle([Variant(CLAIMS[name], 8, BLOCK)], 2)
    caught = []
    for rank, by_name in enumerate(results()):
        outcome = by_name[name]
        assert "error" not in outcome, f"{name} crashed instead of running: {outcome['error']}"
        caught += _misses(outcome, oracle, rank)
    assert caught, f"{name}: every loss and shard met the {CLAIMS[name]} oracle"


def test_the_suite_reads_the_wire_from_the_declared_format():
    """``conformance.lossy_wire.check_wire`` on made-up traces, the sizes computed from the
    declared bits and block and the parameters, never from what the variant says it sent: a
    (6, 4) weight over 2 ranks is a 12-value piece, 2 blocks of 8, so an int8 message of
    2 x 8 codes + 2 fp32 scales = 24 bytes and 48 gathered, an int4 one 16 and 32. An int4
    all-gather that sends a code a byte (48), one that sends bf16, and a qgZ run whose
    gradients were reduce-scattered in fp32 are each caught."""
    from types import SimpleNamespace

    from twinshard.conformance.compare import Checker
    from twinshard.conformance.lossy_wire import check_wire
    from twinshard.conformance.trace import Call
    from twinshard.variants import Communication

    weight = torch.zeros(6, 4, requires_grad=True)
    layout = SimpleNamespace(params=[weight], params_with_grads=lambda: [weight])

    def run(variant, calls) -> list[str]:
        comm = Communication([variant])
        comm.hooks = {"a": {variant.collective: SimpleNamespace(layout=layout)}}
        checker = Checker()
        check_wire(checker, comm, calls, "impl", 2)
        return checker.failures

    int8, int4 = Variant("qwz", 8, BLOCK), Variant("qwz", 4, BLOCK)
    assert run(int8, [Call("all_gather", torch.uint8, 48)]) == []
    assert run(int4, [Call("all_gather", torch.uint8, 32)]) == []
    (byte_a_code,) = run(int4, [Call("all_gather", torch.uint8, 48)])
    assert "packed all-gathers of [48] bytes" in byte_a_code and "32" in byte_a_code
    assert run(int8, [Call("all_gather", torch.bfloat16, 48)]) == [
        "impl: no packed all-gathers: the variant sent no qwz int8, blocks of 8 message",
        "impl: 1 all-gathers sent ['torch.bfloat16']",
    ]
    qgz = Variant("qgz", 8, BLOCK)
    assert run(qgz, [Call("all_to_all", torch.uint8, 48)]) == []
    assert run(qgz, [Call("reduce_scatter", torch.float32, 64)]) == [
        "impl: 1 floating reduce-scatters",
        "impl: no all-to-all in torch.uint8: the gradients were not exchanged",
    ]


BF16_WEIGHTS = '''
"""A researcher's variant: fp32 weights all-gathered in bf16, declared as such."""
import torch
import torch.distributed as dist


class Gather:
    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        low = torch.empty(output_tensor.shape, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(low, input_tensor.to(SENT), group=group)
        output_tensor.copy_(low)


class Bf16Weights:
    name, step = "bf16 weights", 2.0**-8

    def attach(self, model, mesh):
        for module in model.modules():
            if hasattr(module, "set_custom_all_gather"):
                module.set_custom_all_gather(Gather())

    def gathered(self, full, ranks):
        return full.to(torch.bfloat16).to(full.dtype)

    def gradient_sum(self, contributions, ranks):
        return torch.stack(contributions).sum(0)


SENT = torch.bfloat16
VARIANT = Bf16Weights()
'''


@pytest.mark.parametrize("sent, passes", [("torch.bfloat16", True), ("torch.float16", False)])
def test_conform_certifies_a_variant_of_ones_own(tmp_path, sent, passes):
    """``twinshard conform --variant MODULE:NAME`` runs the ``lossy_given`` case on a variant
    the project has never seen: right as declared, it passes; sending fp16 where it declares
    bf16 (the same bytes, other numbers) misses its own oracle."""
    import os
    import subprocess
    import sys

    (tmp_path / "my_variant.py").write_text(
        BF16_WEIGHTS.replace("torch.bfloat16\nVARIANT", f"{sent}\nVARIANT")
    )
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    )
    args = "conform twinshard.optimized --cases lossy_given --world-sizes 2".split()
    run = subprocess.run(
        [sys.executable, "-m", "twinshard.cli", *args, "--variant", "my_variant:VARIANT"],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert (run.returncode == 0) is passes, run.stdout[-3000:] + run.stderr[-3000:]
    assert ("1 pass" if passes else "lossy_given on 2: FAIL") in run.stdout
