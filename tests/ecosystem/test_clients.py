"""twinshard under the trainers people use, switched on with ``twinshard.switch``.

accelerate's FSDP2 plugin, Lightning's ``ModelParallelStrategy`` and the HF ``Trainer`` with
FSDP2 each train a tiny ``transformers`` Llama (built from a config, no download) for a few
steps on 2 gloo ranks, once under torch's own ``fully_shard`` and once under each twinshard
implementation, switched in with ``twinshard.switch.using``. Every twinshard run must be
bitwise equal to torch's on every rank: the loss and the gradient norm of every step, every
parameter shard and every optimizer-state shard at the end. Then each twinshard
implementation resumes torch's checkpoint (saved by the client's own mechanism after step 2)
and must end bitwise where torch's uninterrupted run ended. Last, each implementation trains
with communication variants set by the switch (``qwz+qgz`` at the default block, which every
client's own ``fully_shard`` calls get, the lists of modules accelerate and the Trainer shard as
one group included): the three must be bitwise equal to each other there too, and differ from
the exact run. How each client is brought to its
FSDP2 path on gloo is said in its file (client_accelerate.py, client_lightning.py,
client_trainer.py).

All three clients run in one launch of 2 fresh ranks (the clients' imports and first steps
are most of the time), shared by the tests of this module.

The clients come with the ``clients`` extra (``pip install torch==2.13.0 -e ".[clients]"``).
Without them the tests fail when ``CI`` is set and are skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from twinshard.ranks.launch import launch

CLIENTS = {"accelerate": "accelerate", "lightning": "lightning", "trainer": "transformers"}


def clients_missing() -> list[str]:
    return [pkg for pkg in set(CLIENTS.values()) if importlib.util.find_spec(pkg) is None]


def every_client(folder: str) -> dict:
    """On each rank: client -> run name -> Record (client_common.Record)."""
    import client_accelerate
    import client_lightning
    import client_trainer

    order = {"lightning": client_lightning, "accelerate": client_accelerate}
    order["trainer"] = client_trainer
    return {name: module.ranks(f"{folder}/{name}") for name, module in order.items()}


@pytest.fixture(scope="module")
def client_runs(tmp_path_factory):
    missing = clients_missing()
    if missing:
        message = f"{', '.join(sorted(missing))} not installed (pip install -e '.[clients]')"
        if os.environ.get("CI"):
            pytest.fail(message + "; CI must run the client tests")
        pytest.skip(message)
    folder = tmp_path_factory.mktemp("clients")
    return launch(every_client, 2, str(folder), timeout=600, env={"TWINSHARD_THREADS": "1"})


@pytest.mark.parametrize("client", list(CLIENTS))
def test_client_is_bitwise_equal_to_torch_and_resumes_its_checkpoint(client_runs, client):
    from client_common import IMPLS, WITH_VARIANTS, compare_runs

    per_rank = [runs[client] for runs in client_runs]
    expected = {"torch", "reference", "optimized", "reference resumed", "optimized resumed"}
    expected |= {impl + WITH_VARIANTS for impl in IMPLS}
    assert set(per_rank[0]) == expected
    assert all(len(r.loss) > 0 and len(r.params) > 0 for r in per_rank[0].values())
    report = compare_runs(per_rank)
    assert report == {run: [] for run in expected}, report
    for runs in per_rank:  # the variants changed the numbers: they were set and ran
        assert runs["torch" + WITH_VARIANTS].differences(runs["torch"]), client


def test_the_comparison_sees_one_ulp_and_a_run_torch_sharded():
    """What the client test relies on: a parameter one ulp off, a loss one ulp off, and a
    'twinshard' run whose model torch's fully_shard sharded are each reported."""
    import torch
    from client_common import Record, compare_runs

    def record(by: str, weight: float = 1.0, loss: float = 2.0, steps: int = 4) -> Record:
        w = torch.tensor([weight])
        return Record([loss] * steps, [3.0] * steps, {"w": w}, {"w/momentum_buffer": w}, by)

    one_ulp = float(torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)))
    runs = {
        "torch": record("torch"),
        "reference": record("reference", weight=one_ulp),
        "optimized": record("torch"),
        "optimized resumed": record(
            "optimized", steps=2, loss=float(torch.nextafter(torch.tensor(2.0), torch.tensor(3.0)))
        ),
    }
    report = compare_runs([runs])
    assert report["torch"] == []
    assert report["reference"] == [
        "rank 0: params[w] differs",
        "rank 0: optim[w/momentum_buffer] differs",
    ]
    assert report["optimized"] == ["rank 0: the model was sharded by torch"]
    assert len(report["optimized resumed"]) == 1 and "loss" in report["optimized resumed"][0]
