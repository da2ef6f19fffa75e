"""Variants through the switch (``variants/switched.py``): code that calls torch's
``fully_shard`` itself, as trainers do, gets the variants on every module it shards when the
switch names them, under torch's own ``fully_shard``, the reference and the optimized path.

Each run trains the same small model twice: once with the variants set by the switch, once
with ``variants.attach`` called by hand after sharding. The two must agree bit for bit (the
same variants on the same modules) and both must differ from the exact run (the variants did
something). At four ranks qgZ goes by node of 2, so the switch must make the node groups
itself, from the mesh ``fully_shard`` used when the script passed none.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch
from test_variants import Net  # the model the variants' own tests train

from twinshard import switch
from twinshard.ranks.launch import launch
from twinshard.variants import attach, parse, sent_bytes

IMPLS = {"torch": "torch.distributed.fsdp", "reference": "twinshard.reference"}
IMPLS["optimized"] = "twinshard.optimized"
FLAT = "qwz:block=8+qgz:block=8"
BY_NODE = "qwz:block=8+qgz:block=8:node=2"


def _train(impl: str, spec: str, how: str, build=None, groups=None, steps: int = 2) -> dict:
    """Shard ``Net`` (a, b, then the root), or ``build()``'s model by ``groups(model)`` (the
    modules or lists of modules to shard, in order), and train ``steps`` steps; ``how``:
    "switch" (the variants come with the switched ``fully_shard``, no mesh passed) or "by
    hand" (``attach``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = (build or Net)()
    groups = groups or (lambda m: (m.a, m.b, m))
    if how == "switch":
        switch.use(impl, spec)
        from torch.distributed.fsdp import fully_shard  # as a trainer looks it up, at call time
    else:
        fully_shard = importlib.import_module(IMPLS[impl]).fully_shard
    try:
        for module in groups(model):
            fully_shard(module) if how == "switch" else fully_shard(module, mesh=mesh)
        hooks = fully_shard.hooks if how == "switch" else attach(model, parse(spec), mesh)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(steps):
            model(torch.randn(4, 6, generator=generator)).pow(2).sum().backward()
            optim.step()
            optim.zero_grad()
    finally:
        switch.restore()
    shards = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    return {"shards": shards, "sent": sent_bytes(hooks) if spec else {}}


def _all(cases: list[tuple[str, str]]) -> dict:
    out = {}
    for impl, spec in cases:
        for how in ("switch", "by hand"):
            out[impl, spec, how] = _train(impl, spec, how)
        out[impl, "", "exact"] = _train(impl, "", "by hand")
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return launch(_all, 2, [(impl, FLAT) for impl in IMPLS])


@pytest.mark.parametrize("impl", list(IMPLS))
def test_the_switch_sets_the_variants_as_attach_does(two_ranks, impl):
    for rank in two_ranks:
        switched, by_hand = rank[impl, FLAT, "switch"], rank[impl, FLAT, "by hand"]
        exact = rank[impl, "", "exact"]
        assert switched["sent"] == by_hand["sent"] and switched["sent"]["all_gather"] > 0
        assert switched["sent"]["reduce_scatter"] > 0
        for name, shard in by_hand["shards"].items():
            assert torch.equal(switched["shards"][name], shard), name
        assert any(not torch.equal(s, exact["shards"][n]) for n, s in by_hand["shards"].items())


def test_qgz_by_node_through_the_switch_makes_its_groups():
    for rank in launch(_all, 4, [("torch", BY_NODE)]):
        switched, by_hand = rank["torch", BY_NODE, "switch"], rank["torch", BY_NODE, "by hand"]
        assert switched["sent"] == by_hand["sent"] and switched["sent"]["reduce_scatter"] > 0
        for name, shard in by_hand["shards"].items():
            assert torch.equal(switched["shards"][name], shard), name


def test_unusable_variants_are_refused_before_anything_is_switched(tmp_path):
    with pytest.raises(switch.SwitchError, match="more than one variant replaces"):
        switch.use("torch", "qgz+bf16-wire")
    assert switch.active() == "torch" and switch.active_variants() == ""
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    command = [sys.executable, "-m", "twinshard.run", "--variants", "qxz", str(script)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "ran" not in done.stdout
    assert "TWINSHARD_VARIANTS='qxz'" in done.stderr and "unknown variant 'qxz'" in done.stderr
