"""``twinshard.clip_grad.clip_grad_norm_``: torch's gradient clipping on the local shards.

On 2 gloo ranks, a small model sharded by the optimized path and by torch's ``fully_shard``, on
a 1-D mesh and on HSDP meshes of 1x2 and 2x1, gets rank-dependent gradients; then torch's
``clip_grad_norm_`` and this one each clip a copy of them, for the 2-, 1- and infinity norms,
with and without ``foreach``, with a ``max_norm`` that clips and one that does not. The
gradients and the total norms must be equal bit for bit. Every call of this one reads nothing
on the host (no ``aten._local_scalar_dense``), and one with ``error_if_nonfinite`` reads once
and raises on every rank alike for a non-finite norm.
"""

import pytest
import torch

from twinshard.ranks.launch import launch

SETTINGS = [  # (norm_type, foreach, max_norm)
    (2.0, None, 0.05),
    (2.0, None, 1e3),
    (2.0, False, 0.05),
    (1.0, None, 0.05),
    (float("inf"), None, 0.01),
]


def _model(impl: str, shape: tuple):
    import importlib

    from torch.distributed.device_mesh import init_device_mesh

    fully_shard = importlib.import_module(impl).fully_shard
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")  # 2-D: HSDP
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3, bias=False)]
    model = torch.nn.Sequential(*layers)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.manual_seed(100 + torch.distributed.get_rank())
    model(torch.randn(5, 6)).square().mean().backward()
    return model


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the reads of a tensor's value on the host."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def _compare(impl: str, shape: tuple) -> dict:
    from twinshard.clip_grad import clip_grad_norm_

    model = _model(impl, shape)
    params = list(model.parameters())
    start = [p.grad.to_local().clone() for p in params]
    found = {}
    for norm_type, foreach, max_norm in SETTINGS:
        totals, grads, reads = [], [], 0
        for clip in (torch.nn.utils.clip_grad_norm_, clip_grad_norm_):
            for p, g in zip(params, start):
                p.grad.to_local().copy_(g)
            counter = _HostReads()
            with counter:
                total = clip(params, max_norm, norm_type, foreach=foreach)
            reads = counter.reads if clip is clip_grad_norm_ else reads
            totals.append(total.full_tensor())
            grads.append([p.grad.to_local().clone() for p in params])
        found[norm_type, foreach, max_norm] = {
            "total": torch.equal(*totals),
            "grads": all(map(torch.equal, *grads)),
            "clipped": not all(map(torch.equal, grads[1], start)),
            "reads": reads,
        }
    params[0].grad.to_local().view(-1)[0] = float("inf")
    counter = _HostReads()
    try:
        with counter:
            clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
        found["nonfinite"] = "no error"
    except RuntimeError as error:
        found["nonfinite"] = str(error)
    found["nonfinite reads"] = counter.reads
    return found


@pytest.mark.parametrize("shape", [(2,), (1, 2), (2, 1)], ids=["2", "1x2", "2x1"])
@pytest.mark.parametrize("impl", ["twinshard.optimized", "torch.distributed.fsdp"])
def test_the_clipped_gradients_and_the_total_are_torchs_bit_for_bit(impl, shape):
    for found in launch(_compare, 2, impl, shape):
        for (norm_type, foreach, max_norm), seen in (
            (k, v) for k, v in found.items() if isinstance(k, tuple)
        ):
            assert seen["total"] and seen["grads"], (norm_type, foreach, max_norm, seen)
            assert seen["clipped"] == (max_norm < 1.0), (norm_type, max_norm, seen)
            assert seen["reads"] == 0, (norm_type, foreach, seen)
        assert "clip_grad_norm_" in found["nonfinite"] and "non-finite" in found["nonfinite"]
        assert found["nonfinite reads"] == 1, found


def test_what_it_does_not_shard_goes_to_torchs_own():
    from twinshard.clip_grad import clip_grad_norm_

    found = []
    for clip in (torch.nn.utils.clip_grad_norm_, clip_grad_norm_):
        plain = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))]
        plain[0].grad, plain[1].grad = torch.tensor([3.0, 4.0]), torch.tensor([1.0, 2.0, 2.0])
        found.append((clip(plain, 1.0), [p.grad for p in plain]))
    (total, grads), (mine, my_grads) = found
    assert torch.equal(total, mine) and mine.item() == pytest.approx(34**0.5)
    assert all(map(torch.equal, grads, my_grads)) and my_grads[0][0] < 3.0
