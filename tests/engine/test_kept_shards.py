"""The optimized path keeps each parameter's block padded, in storage its group owns, as the
sharded ``DTensor``'s local tensor ([Note: the group keeps its blocks padded] in
``optimized/flat_group.py``). Checked on 2 gloo ranks, with a layer of 5 rows (rank 1 holds two
rows and one padding row): the parameters stay the same objects, their local tensors are views
of the kept blocks, the padding is zero, the optimizer's updates reach the next all-gather, a
parameter loaded with ``assign=True`` is moved in again, the state dict still pickles, and a
group whose dtypes became mixed takes each block on its own again.
"""

import copy
import io

import torch
import torch.nn as nn

from twinshard.ranks.launch import launch
from twinshard.reference.state import get_state


def _plain_and_sharded():
    import twinshard.optimized as O

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    model = copy.deepcopy(plain)
    O.fully_shard(model[0])
    O.fully_shard(model)
    return plain, model


def _kept_blocks(model) -> list:
    return [t for m in (model[0], model) for t in get_state(m).group.kept_blocks]


def _is_kept(param, blocks) -> bool:
    local = param.to_local()
    return any(local.data_ptr() == b.data_ptr() for b in blocks)


def _train_and_reload():
    plain, model = _plain_and_sharded()
    before = list(model.parameters())
    x = torch.randn(6, 4)
    found = {}
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (plain, model)]
    for _ in range(3):
        for m, opt in zip((plain, model), opts):
            m(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
    found["same_objects"] = all(a is b for a, b in zip(before, model.parameters()))
    blocks = _kept_blocks(model)
    found["all_kept"] = all(_is_kept(p, blocks) for p in model.parameters())
    w = model[0].weight  # 5 rows: rank 0 holds 3, rank 1 holds 2 and a padding row
    found["local_rows"] = w.to_local().shape[0]
    kept = next(b for b in blocks if b.data_ptr() == w.to_local().data_ptr()).view(3, 4)
    found["padding_zero"] = bool((kept[w.to_local().shape[0] :] == 0).all())
    with torch.no_grad():  # the optimizer's updates reached the all-gather: same forward
        found["after_steps"] = (model(x) - plain(x)).abs().max().item()
    # new DTensors, assigned: moved into the kept storage at the next unshard
    halved = {k: v.detach().clone() * 0.5 for k, v in model.state_dict().items()}
    model.load_state_dict(halved, assign=True)
    plain.load_state_dict({k: v.full_tensor() for k, v in halved.items()})
    with torch.no_grad():
        found["after_assign"] = (model(x) - plain(x)).abs().max().item()
    model.reshard()  # the root keeps its parameters unsharded after forward
    found["assigned_objects"] = model[0].weight is not w
    found["assigned_kept"] = all(_is_kept(p, _kept_blocks(model)) for p in model.parameters())
    torch.save(model.state_dict(), io.BytesIO())  # raises if a kept view cannot be pickled
    # one parameter of another dtype since: the group takes each block on its own again
    first = model[0]
    group = get_state(first).group
    found["kept_before_mixed"] = group.kept_shards(group.params) is not None
    wide = {"weight": first.weight.detach().to(torch.float64), "bias": first.bias.detach()}
    first.load_state_dict(wide, assign=True)
    found["kept_when_mixed"] = group.kept_shards(group.params) is not None
    return found


def test_the_group_keeps_the_blocks_and_follows_replaced_parameters():
    results = launch(_train_and_reload, 2, backend="gloo")
    for found in results:
        assert found["same_objects"], "keeping the blocks must not replace the parameters"
        assert found["all_kept"], "a local tensor is not a view of its group's kept block"
        assert found["padding_zero"], "the padding rows of a kept block must be zero"
        assert found["after_steps"] < 1e-5, found
        assert found["assigned_objects"]
        assert found["assigned_kept"], "an assigned parameter was not moved into the storage"
        assert found["after_assign"] < 1e-5, found
        assert found["kept_before_mixed"]
        assert not found["kept_when_mixed"], "a group of mixed dtypes cannot keep one layout"
    assert [f["local_rows"] for f in results] == [3, 2]


def _storage_choices():
    """Where each block is kept after operations that give the parameters new local tensors."""
    from torch.distributed.tensor import DTensor

    _, model = _plain_and_sharded()
    rank = torch.distributed.get_rank()
    w = model[0].weight  # (5, 4): rank 0 holds its whole block of 3 rows, rank 1 two of three
    found = {"rows": w.to_local().shape[0]}
    early = model.state_dict()["0.weight"].to_local()  # taken before any step
    found["early_is_kept"] = _is_kept(w, [early])
    before = [b.data_ptr() for b in _kept_blocks(model)]
    model.to("cpu")  # new local tensors that still start the kept blocks: nothing moves
    found["to_moves_nothing"] = [b.data_ptr() for b in _kept_blocks(model)] == before
    given = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.load_state_dict(given, assign=True)
    # a whole padded block is kept as it is (no copy), a shorter one is moved into new memory
    found["given_is_kept"] = _is_kept(model[0].weight, [given["0.weight"].to_local()])
    wide = torch.randn(4, w.to_local().shape[0]).t()  # the same shape, not contiguous
    spec = model[0].weight
    odd = DTensor.from_local(
        wide, spec.device_mesh, spec.placements, shape=spec.shape, stride=spec.stride()
    )
    model[0].load_state_dict({"weight": odd, "bias": model[0].bias.detach()}, assign=True)
    kept = model[0].weight.to_local()
    found["odd_copied"] = kept.is_contiguous() and torch.equal(kept, wide)
    found["odd_kept"] = _is_kept(model[0].weight, _kept_blocks(model))
    found["rank"] = rank
    return found


def test_blocks_are_kept_when_made_and_when_replaced():
    """[Note: the kept blocks alias the sharded parameters]: a state dict taken right after
    fully_shard is a view of the kept block; ``module.to`` that changes nothing moves no block;
    an assigning load keeps a whole padded block as it is and copies a shorter or
    non-contiguous one into new memory."""
    results = launch(_storage_choices, 2, backend="gloo")
    for found in results:
        assert found["early_is_kept"], "the early state dict is not the kept block"
        assert found["to_moves_nothing"], "module.to moved blocks although nothing changed"
        whole = found["rows"] == 3  # rank 0
        assert found["given_is_kept"] == whole, found
        assert found["odd_copied"] and found["odd_kept"], found
    assert [f["rows"] for f in results] == [3, 2]
