"""``twinshard plan`` against ``twinshard bench`` at small scale, measured (issue 26, item 3).

The same job, a small Llama on 2 ranks over the simulated network (``bench --backend simnet
--world 2``, which really runs the step on this CPU), is planned with ``--device cpu`` and
measured by ``twinshard bench``:

- memory: the plan's probe (``bench.probe``'s categories at their peak, recorded under
  ``FakeTensorMode``) equals the bench's measured one, category by category, to the byte,
  for the optimized path and torch's ``fully_shard`` (the reference's differs by one gradient
  the probe sees only under fake tensors: a strict xfail; its device memory, recorded with
  fake and with real tensors by the same code, is the same to the byte);
- time: the plan's predicted step for this CPU (constants measured here as the plan starts,
  ``profiles.measure_cpu``) is within 20% of the measured step. The measured step is its CPU
  time (``time.process_time`` of the rank's process, ``bench``'s ``cpu_s``): on the shared
  cores of CI a wall-clock step is as long as the neighbours make it, and the plan predicts a
  step on a core of its own. The CPU's one efficiency constant (``profiles.CPU_EFFICIENCY``)
  was fitted once, on torch's run of this test.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from twinshard.bench.cli import side_by_side
from twinshard.bench.config import RunConfig
from twinshard.plan.cli import plan
from twinshard.plan.config import PlanConfig

IMPLS = ("reference", "optimized", "torch")
SHAPE = dict(world=2, seq=128, dtype="fp32")
LAYERS = 4


@pytest.fixture(scope="module")
def measured_and_planned():
    bench = RunConfig(
        preset="small",
        model={"n_layers": LAYERS},
        per_rank=2,
        steps=4,
        warmup=2,
        backend="simnet",
        link="ib",
        **SHAPE,
    )
    measured = side_by_side(bench, list(IMPLS), repeat=1, progress=False, overlap=False)
    configs = [
        PlanConfig(
            model="small",
            layers=LAYERS,
            batch=2,
            impl=impl,
            device="cpu",
            network="simnet:ib",
            optimizer="sgd",
            probe=True,
            **SHAPE,
        )
        for impl in IMPLS
    ]
    planned = dict(zip(IMPLS, plan(configs, progress=False)))
    for impl, row in planned.items():
        assert "error" not in row, f"{impl}: {row.get('error')}"
    return measured["summary"], planned


# The reference's probe view differs under FakeTensorMode: bench.probe counts a gradient only
# if it samples while the gradient is on its parameter, and under fake tensors it sees one of
# the root's gradients (8 MiB) that it never sees in the real run (64.1 MB measured, 68.0
# planned). The device's memory is the same: see the next test.
REFERENCE_OPEN = pytest.mark.xfail(
    strict=True, reason="the probe sees one gradient more under FakeTensorMode (see above)"
)


def test_the_reference_device_memory_is_the_same_with_real_tensors():
    """The reference's device peak and its parts, recorded with FakeTensors and with real
    tensors by the same code, to the byte."""
    base = PlanConfig(
        model="small",
        layers=LAYERS,
        batch=2,
        impl="reference",
        device="cpu",
        optimizer="sgd",
        **SHAPE,
    )
    fake, real = plan([base, replace(base, real=True)], progress=False)
    assert "error" not in fake and "error" not in real, (fake.get("error"), real.get("error"))
    assert fake["memory"]["peak_bytes"] == real["memory"]["peak_bytes"] > 0
    assert fake["memory"]["parts"] == real["memory"]["parts"]


@pytest.mark.parametrize(
    "impl", [pytest.param("reference", marks=REFERENCE_OPEN), "optimized", "torch"]
)
def test_planned_memory_is_the_measured_memory(measured_and_planned, impl):
    measured, planned = measured_and_planned
    assert planned[impl]["memory"]["probe"] == measured[impl]["memory"]
    assert sum(measured[impl]["memory"].values()) > 0


@pytest.mark.parametrize("impl", IMPLS)
def test_planned_time_is_within_a_fifth_of_the_measured_step(measured_and_planned, impl):
    measured, planned = measured_and_planned
    predicted, cpu = planned[impl]["time"]["step_s"], measured[impl]["cpu_s"]
    assert 0.8 <= predicted / cpu <= 1.2, (impl, predicted, cpu)
