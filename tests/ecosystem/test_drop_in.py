"""What a user swapping torch's fully_shard for twinshard's meets beyond the conformance cases:
share_comm_ctx, dp_mesh_dims, torch.compile of the whole model, and the wording of two errors
(a tie split across groups, a parameter left on the meta device)."""

import pytest
import torch

from twinshard.ranks.launch import launch

IMPLS = ["twinshard.reference", "twinshard.optimized"]


def _two_roots_share_one_context(impl_name):
    import importlib

    from twinshard.models import MLPStack
    from twinshard.reference.state import get_state

    impl = importlib.import_module(impl_name)
    torch.manual_seed(0)
    stages = [MLPStack(dim=8, hidden=16, n_blocks=1) for _ in range(2)]  # two pipeline stages
    for stage in stages:
        impl.fully_shard(stage.blocks[0])
        impl.fully_shard(stage)
    impl.share_comm_ctx(stages)
    x = torch.randn(4, 8)
    stages[1](stages[0](x)).sum().backward()
    comms = {id(getattr(get_state(m), "comm", None)) for s in stages for m in (s, s.blocks[0])}
    grads = all(p.grad is not None for s in stages for p in s.parameters())
    return len(comms), grads


@pytest.mark.parametrize("impl", IMPLS)
def test_share_comm_ctx(impl):
    contexts, grads = launch(_two_roots_share_one_context, 2, impl)[0]
    assert grads
    assert contexts == 1  # the optimized path's roots share one context; the reference has none


def _tp_with_dp_mesh_dims(impl_name):
    import importlib

    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    impl = importlib.import_module(impl_name)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    plain = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    plain.load_state_dict(model.state_dict())
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    impl.fully_shard(model, mesh=mesh, dp_mesh_dims=impl.DataParallelMeshDims(shard="dp"))
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    dp = mesh["dp"].get_local_rank()
    model(x[dp * 4 : (dp + 1) * 4]).pow(2).mean().backward()
    plain(x).pow(2).mean().backward()
    return max(
        float((p.grad.full_tensor() - q.grad).abs().max())
        for p, q in zip(model.parameters(), plain.parameters())
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_tensor_parallel_with_dp_mesh_dims(impl):
    worst = max(launch(_tp_with_dp_mesh_dims, 4, impl))
    assert worst < 1e-6, worst


def _compile_whole_model(impl_name):
    import importlib

    from twinshard.models import MLPStack

    impl = importlib.import_module(impl_name)
    torch.manual_seed(0)
    model = MLPStack(dim=16, hidden=32, n_blocks=2)
    plain = MLPStack(dim=16, hidden=32, n_blocks=2)
    plain.load_state_dict(model.state_dict())
    for block in model.blocks:
        impl.fully_shard(block)
    impl.fully_shard(model)
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    rank = torch.distributed.get_rank()
    for _ in range(2):  # the second step runs the compiled graphs again
        compiled(x[rank * 4 : (rank + 1) * 4]).pow(2).mean().backward()
        plain(x).pow(2).mean().backward()
    pairs = zip(model.parameters(), plain.parameters())
    return max(float((p.grad.full_tensor() - q.grad).abs().max()) for p, q in pairs)


@pytest.mark.parametrize("impl", IMPLS)
def test_torch_compile_of_the_whole_model(impl):
    worst = max(launch(_compile_whole_model, 2, impl))
    assert worst < 1e-6, worst


def _errors(impl_name):
    import importlib

    from twinshard.models import Llama, LlamaConfig

    impl = importlib.import_module(impl_name)
    messages = []
    model = Llama(LlamaConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, tie_embeddings=True))
    impl.fully_shard(model.output)  # shares its weight with tok_embeddings, a sibling
    try:
        impl.fully_shard(model)
    except ValueError as error:
        messages.append(str(error))
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    impl.fully_shard(meta)
    meta.to_empty(device="cpu")
    meta[0][0]._parameters["weight"] = torch.nn.Parameter(torch.empty(4, 4, device="meta"))
    try:
        meta(torch.zeros(1, 4))
    except ValueError as error:
        messages.append(str(error))
    return messages


@pytest.mark.parametrize("impl", IMPLS)
def test_error_messages_name_what_is_wrong(impl):
    tie, meta = launch(_errors, 2, impl)[0]
    assert "'tok_embeddings.weight'" in tie and "'output'" in tie, tie
    assert "bottom-up" not in tie, tie
    assert "'0.0.weight'" in meta, meta  # the full path, not the owner's attribute alone


def _recovery_and_options(impl_name):
    """A backward that fails midway (after some reduce-scatters were issued), then
    ``reset_iter_state``; a separate reduce-scatter group switched on and off again;
    ``share_comm_ctx`` with no modules and with a module that is not sharded."""
    import importlib

    from twinshard.api import FSDPUsageError
    from twinshard.conformance.models import shard_blocks
    from twinshard.models import MLPStack

    impl = importlib.import_module(impl_name)

    def build():
        torch.manual_seed(0)
        model = MLPStack(dim=8, hidden=16, n_blocks=3)
        shard_blocks(impl, model, mesh=None)
        return model

    def grads(model):
        torch.manual_seed(1)
        model(torch.randn(4, 8)).sum().backward()
        return [p.grad.full_tensor() for p in model.parameters()]

    expected = grads(build())
    model = build()
    model.set_separate_reduce_scatter_group(True)
    model.set_separate_reduce_scatter_group(False)

    def fail(grad):
        raise RuntimeError("planted failure in backward")

    # block 0's output gradient: reached after blocks 2 and 1 issued their reduce-scatters
    def plant(module, args, out):
        out.register_hook(fail)

    handle = model.blocks[0].register_forward_hook(plant)
    failed = False
    try:
        model(torch.randn(4, 8)).sum().backward()
    except RuntimeError:
        failed = True
    handle.remove()
    model.reset_iter_state()
    model.reshard()
    model.zero_grad(set_to_none=True)
    recovered = grads(model)
    same = all(torch.equal(a, b) for a, b in zip(expected, recovered))
    impl.share_comm_ctx([])
    try:
        impl.share_comm_ctx([torch.nn.Linear(2, 2)])
        refused = ""
    except FSDPUsageError as error:
        refused = str(error)
    return failed, same, refused


@pytest.mark.parametrize("impl", IMPLS)
def test_recovery_after_a_failed_backward_and_the_remaining_options(impl):
    failed, same, refused = launch(_recovery_and_options, 2, impl)[0]
    assert failed and same
    assert "share_comm_ctx expects modules that fully_shard was applied to" in refused, refused
