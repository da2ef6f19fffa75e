"""torchao's float8 training (``torchao.float8``, all-gathering the weights in float8) under
twinshard, at 2 and 4 ranks over 3 steps (the model and runs: ``support/client_torchao.py``).

- On gloo, the reference and the optimized path train it bit for bit alike, equal to the plain
  model under the same float8 casts to fp32's tolerances (only the gradients' reduction order
  differs), and the weights cross the wire at one byte per value: each step's all-gathers
  carry every weight's float8 codes and every bias in fp32, twice (forward and backward), and
  nothing more.
- torch's ``fully_shard`` cannot run it on gloo (gloo has no float8 dtype), so the three
  implementations run it on the fake accelerator, where torch's does: the optimized path's
  collectives are torch's, one for one (op, dtype, size); the reference's, one per parameter,
  carry the same bytes by operation.

torchao comes with the ``clients`` extra (``pip install torch==2.13.0 -e ".[clients]"``):
without it the tests fail when ``CI`` is set and are skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from twinshard.ranks.launch import launch

WORLDS = (2, 4)
IMPLS = ("twinshard.reference", "twinshard.optimized")
SUPPORT = Path(__file__).parents[1] / "support" / "client_torchao.py"
BYTES = {"torch.uint8": 1, "torch.float8_e4m3fn": 1, "torch.bfloat16": 2, "torch.float32": 4}


@pytest.fixture(scope="module", autouse=True)
def torchao_installed():
    if importlib.util.find_spec("torchao") is None:
        message = "torchao not installed (pip install torch==2.13.0 -e '.[clients]')"
        if os.environ.get("CI"):
            pytest.fail(message + "; CI must run the float8 tests")
        pytest.skip(message)


@pytest.fixture(scope="module")
def gloo_runs() -> dict:
    """(world, implementation) -> what each rank returned."""
    import client_torchao

    return {
        (w, impl): launch(client_torchao.sharded, w, impl, timeout=300)
        for w in WORLDS
        for impl in IMPLS
    }


@pytest.fixture(scope="module")
def fake_runs() -> dict:
    """implementation -> world -> the collectives of its run on the fake accelerator."""
    out = {}
    for impl in ("torch.distributed.fsdp", *IMPLS):
        worlds = ",".join(map(str, WORLDS))
        done = subprocess.run(
            [sys.executable, str(SUPPORT), impl, worlds], capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, f"{impl} on the fake accelerator:\n{done.stderr[-3000:]}"
        out[impl] = {int(w): calls for w, calls in json.loads(done.stdout).items()}
    return out


def _bytes(calls, op: str) -> int:
    return sum(numel * BYTES[dtype] for kind, dtype, numel in calls if kind == op)


def _expected_gather_bytes() -> int:
    """3 steps, each gathering every linear twice, its weight in float8 and its bias in fp32."""
    import client_torchao

    linears = [m for m in client_torchao.build() if isinstance(m, torch.nn.Linear)]
    once = sum(m.weight.numel() * 1 + m.bias.numel() * 4 for m in linears)
    return client_torchao.STEPS * 2 * once


@pytest.mark.parametrize("world", WORLDS)
def test_twinshard_trains_float8_as_the_plain_model_under_the_same_casts(gloo_runs, world):
    import client_torchao

    plain = client_torchao.plain(world)
    reference, optimized = (gloo_runs[world, impl] for impl in IMPLS)
    for rank, (ref, opt) in enumerate(zip(reference, optimized)):
        for name in ("losses",):
            assert all(map(torch.equal, ref[name], opt[name])), f"rank {rank}: {name}"
        for n, p in ref["params"].items():
            assert torch.equal(p, opt["params"][n]), f"rank {rank}: {n}, reference vs optimized"
            torch.testing.assert_close(p, plain["params"][n], msg=f"rank {rank}: {n} vs plain")
        for step, loss in enumerate(ref["losses"]):
            want = plain["losses"][step][rank]
            torch.testing.assert_close(loss, want, msg=f"rank {rank}, step {step}: loss vs plain")


@pytest.mark.parametrize("world", WORLDS)
def test_the_weights_cross_the_wire_in_float8(gloo_runs, world):
    want = _expected_gather_bytes()
    for impl in IMPLS:
        calls = gloo_runs[world, impl][0]["calls"]
        assert _bytes(calls, "all_gather") == want, (impl, _bytes(calls, "all_gather"), want)


@pytest.mark.parametrize("world", WORLDS)
def test_the_collectives_are_torchs_on_the_fake_accelerator(fake_runs, world):
    torch_calls = fake_runs["torch.distributed.fsdp"][world]
    assert _bytes(torch_calls, "all_gather") == _expected_gather_bytes()
    assert fake_runs["twinshard.optimized"][world] == torch_calls
    reference = fake_runs["twinshard.reference"][world]
    for op in ("all_gather", "reduce_scatter"):
        assert _bytes(reference, op) == _bytes(torch_calls, op), op
