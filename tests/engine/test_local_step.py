"""``twinshard.local_step``: the user's optimizer stepping the local shards.

On 2 gloo ranks, a small model sharded by the optimized path (and by torch's ``fully_shard``)
trains three steps with each of torch's optimizers twice, once as it is and once wrapped, from
the same start: the parameters, the optimizer's state and its ``state_dict`` must be equal bit
for bit, the state ``DTensor``s on the parameters' specs. Then what a user does with an
optimizer: torch's ``get_optimizer_state_dict``/``set_optimizer_state_dict`` across the wrapped
and the plain one both ways, a scheduler made before the wrap, ``zero_grad`` freeing the
gradients, a parameter FSDP does not hold, and a parameter given new memory.
``benchmarks/optimizer_step.py`` measures the time.
"""

import pytest
import torch

from twinshard.ranks.launch import launch

OPTIMIZERS = {  # every optimizer local_step takes, each with state; some in several forms
    "adamw-foreach": ("AdamW", dict(lr=1e-2, weight_decay=0.1, foreach=True)),
    "adamw-fused": ("AdamW", dict(lr=1e-2, weight_decay=0.1, fused=True)),
    "adam-amsgrad": ("Adam", dict(lr=1e-2, amsgrad=True, foreach=False)),
    "sgd-momentum": ("SGD", dict(lr=1e-2, momentum=0.9, nesterov=True, foreach=True)),
    "sgd-loop": ("SGD", dict(lr=1e-2, momentum=0.9, foreach=False)),
    "adamax": ("Adamax", dict(lr=1e-2)),
    "nadam": ("NAdam", dict(lr=1e-2)),
    "radam": ("RAdam", dict(lr=1e-2)),
    "adagrad": ("Adagrad", dict(lr=1e-2)),
    "rmsprop": ("RMSprop", dict(lr=1e-2, momentum=0.5, centered=True)),
    "rprop": ("Rprop", dict(lr=1e-2)),
    "adadelta": ("Adadelta", dict(lr=1.0)),
    "asgd": ("ASGD", dict(lr=1e-2, t0=1)),
}


def _model(impl: str, extra: bool = False):
    import importlib

    fully_shard = importlib.import_module(impl).fully_shard
    torch.manual_seed(0)
    layers = [torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3, bias=False)]
    model = torch.nn.Sequential(*layers)
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    if extra:  # a parameter of its own, outside FSDP's hands (as a plain tensor)
        model.scale = torch.nn.Parameter(torch.ones(3))
    return model


def _train(model, optimizer, steps: int, scheduler=None) -> None:
    rank = torch.distributed.get_rank()
    for step in range(steps):
        torch.manual_seed(100 + 10 * step + rank)
        out = model(torch.randn(5, 6))
        if hasattr(model, "scale"):
            out = out * model.scale
        out.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()


def _flat(model) -> list:
    from torch.distributed.tensor import DTensor

    return [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]


def _state(optimizer) -> list:
    """Each parameter's state, in order: (key, local tensor or value, the DTensor's spec)."""
    from torch.distributed.tensor import DTensor

    found = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in sorted(optimizer.state[p].items()):
                spec = (
                    (value.placements, value.shape, value.stride())
                    if isinstance(value, DTensor)
                    else None
                )
                if isinstance(p, DTensor) and value.shape == p.shape and value.dim():
                    assert spec == (p.placements, p.shape, p.stride()), (key, spec)
                found.append((key, value.to_local() if spec else value, spec))
    return found


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        (torch.equal(x, y) and x.dtype == y.dtype) if torch.is_tensor(x) else x == y
        for x, y in zip(a, b)
    )


def _with_plain_tensors(impl: str, kind: str, kwargs: dict):
    """What a run unwrapped would give where torch's ``DTensor`` refuses the optimizer: the
    model's own steps taken by the optimizer over plain copies of its local shards."""
    from torch.distributed.tensor import DTensor

    model = _model(impl)
    twins = [p.to_local().detach().clone().requires_grad_() for p in model.parameters()]
    optimizer = getattr(torch.optim, kind)(twins, **kwargs)

    class Twin:
        def step(self):
            for p, twin in zip(model.parameters(), twins):
                twin.grad = p.grad.to_local().clone()
            optimizer.step()
            with torch.no_grad():
                for p, twin in zip(model.parameters(), twins):
                    p.to_local().copy_(twin)

        def zero_grad(self):
            model.zero_grad()

    _train(model, Twin(), 3)
    state = optimizer.state_dict()
    spec = {
        (key, i): (p.placements, p.shape, p.stride())
        for i, p in enumerate(model.parameters())
        for key, value in optimizer.state[twins[i]].items()
        if isinstance(p, DTensor) and value.shape == p.to_local().shape and value.dim()
    }
    found = [
        (key, value, spec.get((key, i)))
        for i, twin in enumerate(twins)
        for key, value in sorted(optimizer.state[twin].items())
    ]
    return _flat(model), found, state


def _equal_to_unwrapped(impl: str) -> dict:
    """For each of ``OPTIMIZERS``: whether three steps wrapped and unwrapped agree."""
    from twinshard.local_step import ELEMENTWISE, local_step

    assert {kind for kind, _ in OPTIMIZERS.values()} == set(ELEMENTWISE)
    found = {}
    for name, (kind, kwargs) in OPTIMIZERS.items():
        runs = []
        for wrapped in (False, True):
            model = _model(impl)
            optimizer = getattr(torch.optim, kind)(model.parameters(), **kwargs)
            if wrapped:
                assert local_step(optimizer) is optimizer
            try:
                _train(model, optimizer, 3)
            except RuntimeError as error:  # torch's Rprop: DTensor has no rule for its index_put_
                assert not wrapped and "placement" in str(error), error
                runs.append(_with_plain_tensors(impl, kind, kwargs))
                continue
            runs.append((_flat(model), _state(optimizer), optimizer.state_dict()))
        (params_a, state_a, dict_a), (params_b, state_b, dict_b) = runs
        found[name] = {
            "params": _same(params_a, params_b),
            "state": len(state_a) == len(state_b)
            and all(
                k == j and s == t and _same([x], [y])
                for (k, x, s), (j, y, t) in zip(state_a, state_b)
            ),
            "state_dict": dict_a["param_groups"] == dict_b["param_groups"]
            and dict_a["state"].keys() == dict_b["state"].keys(),
            "kinds": sorted(
                {type(v).__name__ for s in dict_b["state"].values() for v in s.values()}
            ),
        }
    return found


@pytest.mark.parametrize("impl", ["twinshard.optimized", "torch.distributed.fsdp"])
def test_the_wrapped_step_is_the_optimizers_own_bit_for_bit(impl):
    for found in launch(_equal_to_unwrapped, 2, impl):
        for name, seen in found.items():
            assert seen["params"] and seen["state"] and seen["state_dict"], (name, seen)
            assert "DTensor" in seen["kinds"], (name, seen)  # as torch's FSDP2 leaves it


def test_an_optimizer_that_reads_across_a_parameter_is_refused():
    from twinshard.local_step import local_step

    weight = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="LBFGS is not one of torch's elementwise"):
        local_step(torch.optim.LBFGS([weight]))

    class Mine(torch.optim.SGD):
        pass

    with pytest.raises(ValueError, match="Mine.*elementwise=True"):
        local_step(Mine([weight], lr=0.1))
    assert local_step(Mine([weight], lr=0.1), elementwise=True)._twinshard_local_step


def _what_a_user_does() -> dict:
    import copy
    import warnings

    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from twinshard.local_step import local_step

    found = {}

    def adamw(model, wrapped: bool):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        return local_step(optimizer) if wrapped else optimizer

    # the optimizer's state, saved from one and loaded into the other, both ways
    for saved_wrapped in (True, False):
        model_a = _model("twinshard.optimized")
        opt_a = adamw(model_a, saved_wrapped)
        _train(model_a, opt_a, 2)
        # a copy, as a checkpoint is: loaded as it is, the state would be opt_a's own tensors
        saved = copy.deepcopy(get_optimizer_state_dict(model_a, opt_a))
        model_b = _model("twinshard.optimized")
        opt_b = adamw(model_b, not saved_wrapped)
        _train(model_b, opt_b, 1)  # state of its own first, which the load replaces
        model_b.load_state_dict(model_a.state_dict())
        set_optimizer_state_dict(model_b, opt_b, saved)
        _train(model_a, opt_a, 2)
        _train(model_b, opt_b, 2)
        found[f"loaded, saved wrapped={saved_wrapped}"] = _same(_flat(model_a), _flat(model_b))

    # a scheduler made before the wrap still steps the learning rate, without a warning
    model = _model("twinshard.optimized")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    local_step(optimizer)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        before = [p.detach().clone() for p in _flat(model)]
        _train(model, optimizer, 2, scheduler)
    found["scheduler lr"] = optimizer.param_groups[0]["lr"]
    found["scheduler warnings"] = [str(w.message) for w in said if "lr_scheduler" in str(w.message)]
    found["scheduler moved"] = not _same(before, _flat(model))
    # and one made after it
    model = _model("twinshard.optimized")
    optimizer = local_step(torch.optim.SGD(model.parameters(), lr=0.1))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        _train(model, optimizer, 2, scheduler)
    found["scheduler after"] = optimizer.param_groups[0]["lr"]
    found["scheduler warnings"] += [str(w.message) for w in said if "lr_sched" in str(w.message)]

    # zero_grad frees: nothing of the step keeps a gradient alive
    stepper = optimizer._twinshard_local_step
    found["aliases without grad"] = all(a.grad is None for a in stepper.aliases)

    # a parameter FSDP does not hold steps with the rest, its state in the optimizer's own dict
    # (torch's foreach refuses plain tensors mixed with DTensors: unwrapped, it needs its own)
    class Both:
        def __init__(self, *optimizers):
            self.optimizers = optimizers

        def step(self):
            for optimizer in self.optimizers:
                optimizer.step()

        def zero_grad(self):
            for optimizer in self.optimizers:
                optimizer.zero_grad()

    model = _model("twinshard.optimized", extra=True)
    sharded = [p for name, p in model.named_parameters() if name != "scale"]
    apart = torch.optim.AdamW(sharded, lr=1e-2, foreach=True)
    scale = torch.optim.AdamW([model.scale], lr=1e-2, foreach=True)
    _train(model, Both(apart, scale), 2)
    mixed = _model("twinshard.optimized", extra=True)
    together = adamw(mixed, True)
    _train(mixed, together, 2)
    found["plain parameter"] = _same(_flat(model), _flat(mixed)) and _same(
        [scale.state[model.scale]["exp_avg"]], [together.state[mixed.scale]["exp_avg"]]
    )

    # a DTensor given a new local tensor between steps is stepped there (the view is built
    # again)
    runs = []
    for wrapped in (False, True):
        model = _model("twinshard.optimized")
        optimizer = adamw(model, wrapped)
        _train(model, optimizer, 1)
        for p in model.parameters():  # what the kept blocks' adopt_local does
            p._local_tensor = p._local_tensor.clone()
        if wrapped:
            found["view rebuilt"] = not optimizer._twinshard_local_step.current()
        _train(model, optimizer, 2)
        runs.append(_flat(model))
    found["new memory"] = _same(*runs)
    return found


def test_state_dicts_schedulers_and_new_memory_work_as_without_it():
    for found in launch(_what_a_user_does, 2):
        for key in ("loaded, saved wrapped=True", "loaded, saved wrapped=False"):
            assert found[key], (key, found)
        assert found["scheduler lr"] == pytest.approx(0.025) and found["scheduler moved"], found
        assert found["scheduler after"] == pytest.approx(0.025), found
        assert found["scheduler warnings"] == [], found
        assert found["aliases without grad"], found
        assert found["plain parameter"] and found["new memory"] and found["view rebuilt"], found
