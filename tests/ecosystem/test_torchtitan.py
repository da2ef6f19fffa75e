"""torchtitan's own trainer through the switch, bitwise against torch's ``fully_shard``.

``torchtitan.train`` (its ``Trainer``, its TOML config, its debug Llama, its DCP checkpoints)
trains 4 steps on 2 gloo ranks, pure FSDP, launched by ``torchrun`` as a user launches it:
once under torch's own ``fully_shard`` and once under each twinshard implementation (the
reference in the full tier) with
``-m twinshard.run --impls NAME`` in front (tests/support/client_torchtitan.py says what the job is,
tests/support/torchtitan_on_cpu.py the small shim that a CPU-only machine needs; docs/clients.md has
both). Every twinshard run must match torch's run bit for bit:

- the loss (global mean and max), the gradient norm, the learning rate and the token count
  that torchtitan logs at every step;
- every entry of its checkpoints after steps 2 and 4 (model, optimizer states, lr scheduler,
  dataloader, train state), each compared with torch's checkpoint of the same step, so that a
  checkpoint that holds stale weights (say, the initial ones) fails;
- a resume: torch's step-2 checkpoint resumed under each twinshard implementation, and the
  optimized path's step-2 checkpoint resumed under torch, each to step 4, must log torch's
  numbers for steps 3 and 4 and save torch's step-4 checkpoint.

torchtitan comes with the ``clients`` extra (``pip install torch==2.13.0 -e ".[clients]"``).
Without it the tests fail when ``CI`` is set and are skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# The optimized path is what a torchtitan user trains with; the reference under torchtitan
# repeats, in the full tier, what the suite checks of it against torch (the same cases, the
# same checkpoints) through the same switch.
TWINSHARD = (pytest.param("reference", marks=pytest.mark.full), "optimized")


def _launched(runs: dict, name: str):
    """The launch ``name`` names ("torch", "reference", "optimized", "IMPL resumes OTHER"),
    made once per module: a resumed run starts from OTHER's step-2 checkpoint."""
    import client_torchtitan as titan

    if name not in runs:
        impl, _, source = name.partition(" resumes ")
        start = None
        if source:
            origin = _launched(runs, source)
            assert not origin.failure(), origin.failure()
            start = origin.checkpoint(titan.RESUME_AT)
        folder = runs["root"] / name.replace(" ", "-")
        runs[name] = titan.launch(impl, runs["toml"], folder, resume_from=start)
    run = runs[name]
    assert not run.failure(), run.failure()
    _assert_sharded_by(run)
    return run


def _assert_sharded_by(run) -> None:
    """torch's run switched nothing; a twinshard run said it switched, on rank 0, and no
    module of torchtitan held on to torch's fully_shard (the switch warns when one does)."""
    if run.impl == "torch":
        assert "twinshard.switch" not in run.output
        return
    assert f"fully_shard is twinshard.{run.impl}'s (was torch)" in run.output, run.output[-3000:]
    assert "still call it" not in run.output, run.output[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if importlib.util.find_spec("torchtitan") is None:
        message = "torchtitan not installed (pip install torch==2.13.0 -e '.[clients]')"
        if os.environ.get("CI"):
            pytest.fail(message + "; CI must run the torchtitan tests")
        pytest.skip(message)
    import client_torchtitan as titan

    root = tmp_path_factory.mktemp("torchtitan")
    return {"root": root, "toml": titan.make_assets(root / "assets")}


def test_torchs_run_trains_and_saves_two_different_checkpoints(runs):
    """What the comparisons stand on: torch's run logs every step and saves whole checkpoints
    at steps 2 and 4 in which every model weight differs (so a checkpoint holding another
    step's weights, or the initial ones, cannot pass for torch's)."""
    import client_torchtitan as titan

    run = _launched(runs, "torch")
    assert sorted(run.scalars()) == list(range(1, titan.STEPS + 1))
    early, late = (titan.read_checkpoint(run.checkpoint(s)) for s in (2, 4))
    weights = [k for k in late if titan.is_model_weight(k)]
    assert len(weights) == 1 + 6 * 9 + 2  # embedding; 6 blocks of 7 linears, 2 norms; norm, output
    assert all(not torch.equal(early[k], late[k]) for k in weights)
    for part in ("optimizer/", "lr_scheduler/", "dataloader/", "train_state/"):
        assert any(k.startswith(part) for k in late), part
    assert late["train_state/step"] == 4 and early["train_state/step"] == 2


@pytest.mark.parametrize("impl", TWINSHARD)
def test_losses_and_grad_norms_are_torchs_bitwise(runs, impl):
    import client_torchtitan as titan

    truth, mine = _launched(runs, "torch").scalars(), _launched(runs, impl).scalars()
    steps = range(1, titan.STEPS + 1)
    assert titan.scalar_differences(mine, truth, steps) == []


@pytest.mark.parametrize("impl", TWINSHARD)
@pytest.mark.parametrize("step", [2, 4])
def test_every_checkpoint_tensor_is_torchs_at_the_same_step(runs, impl, step):
    import client_torchtitan as titan

    truth = titan.read_checkpoint(_launched(runs, "torch").checkpoint(step))
    mine = titan.read_checkpoint(_launched(runs, impl).checkpoint(step))
    found = titan.checkpoint_differences(mine, truth)
    assert found == [], f"{len(found)} of {len(truth)} entries: {found[:12]}"


@pytest.mark.parametrize(
    "name",
    [
        # the reference loads torch's checkpoint as the optimized path does (the same
        # ShardedParam and state dict code), so its resume repeats that check
        pytest.param("reference resumes torch", marks=pytest.mark.full),
        "optimized resumes torch",
        "torch resumes optimized",
    ],
)
def test_a_resumed_checkpoint_ends_where_torchs_uninterrupted_run_ended(runs, name):
    import client_torchtitan as titan

    truth, resumed = _launched(runs, "torch"), _launched(runs, name)
    assert f"Training starts at step {titan.RESUME_AT + 1}" in resumed.output
    steps = range(titan.RESUME_AT + 1, titan.STEPS + 1)
    assert sorted(resumed.scalars()) == list(steps)
    assert titan.scalar_differences(resumed.scalars(), truth.scalars(), steps) == []
    found = titan.checkpoint_differences(
        titan.read_checkpoint(resumed.checkpoint(titan.STEPS)),
        titan.read_checkpoint(truth.checkpoint(titan.STEPS)),
    )
    assert found == [], f"{len(found)} entries: {found[:12]}"


def test_the_comparisons_see_one_ulp_a_dtype_and_a_missing_entry():
    """What the tests above rely on, without torchtitan: one ulp in a tensor or a logged
    value, a changed dtype, a missing or extra entry and a changed plain value are reported."""
    import client_torchtitan as titan

    w = torch.tensor([1.0, 2.0])
    truth = {"w.weight": w, "optimizer/state.w.weight.step": torch.tensor(2.0), "x/n": 3}
    assert titan.checkpoint_differences(dict(truth), truth) == []
    nudged = torch.nextafter(w, torch.tensor(3.0))
    mine = {**truth, "w.weight": torch.stack([w[0], nudged[1]])}
    assert titan.checkpoint_differences(mine, truth) == ["differs: w.weight"]
    mine = {**truth, "w.weight": w.double(), "x/n": 4, "extra": 1}
    del mine["optimizer/state.w.weight.step"]
    assert titan.checkpoint_differences(mine, truth) == [
        "missing: optimizer/state.w.weight.step",
        "unexpected: extra",
        "differs: w.weight",
        "differs: x/n",
    ]
    one = {name: 2.0 for name in titan.SCALARS}
    ulp = {**one, "grad_norm": float(torch.nextafter(torch.tensor(2.0), torch.tensor(3.0)))}
    assert titan.scalar_differences({1: one, 2: one}, {1: one, 2: one}, [1, 2]) == []
    assert titan.scalar_differences({1: one, 2: ulp}, {1: one, 2: one}, [1, 2]) == [
        f"step 2 grad_norm: {ulp['grad_norm']!r} != 2.0"
    ]
    assert len(titan.scalar_differences({1: one}, {1: one, 2: one}, [1, 2])) == len(titan.SCALARS)
    assert titan.is_model_weight("layers.0.attention.wq.weight")
    assert not titan.is_model_weight("optimizer/state.layers.0.attention.wq.weight.exp_avg")
