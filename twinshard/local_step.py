"""The user's optimizer stepping the local shards of FSDP's ``DTensor`` parameters directly.

``local_step(optimizer)`` makes ``optimizer.step()`` run the optimizer's own step over plain
tensors: the local shard of each ``DTensor`` parameter, its gradient's local shard, and the
local shards of its state. The optimizer, its hyperparameters, its state (``DTensor``s keyed
by the ``DTensor`` parameters, as torch's FSDP2 leaves them), ``state_dict``,
``load_state_dict``, torch's ``get_optimizer_state_dict``/``set_optimizer_state_dict``, DCP and
learning-rate schedulers are unchanged. It takes torch's optimizers whose step is elementwise
over each parameter (``ELEMENTWISE``: SGD, Adam, AdamW and eight more; others only when told
they are), over any FSDP2-style ``DTensor`` parameters, torch's included; it returns the
optimizer.

[Note: the optimizer over local shards]
FSDP2 gives the optimizer ``DTensor`` parameters, so each of the optimizer's operations goes
through ``DTensor``'s dispatch in Python before it reaches the kernel the same step over plain
tensors calls. With 64 blocks of 9 parameters on a fake world of 8 (``python
benchmarks/optimizer_step.py``), torch's ``fully_shard`` makes AdamW's step about 2x the same
step over plain tensors with ``foreach``, 5x without it and 11x with ``fused``, and torch's
fused SGD refuses ``DTensor`` parameters outright. The step of such an optimizer is elementwise
over each parameter's shard: what ``DTensor``'s dispatch adds is the unwrapping, not any
arithmetic, so the same kernels over the local tensors give the same bits.

How a step goes: the optimizer's param groups and state are swapped, for the length of its step,
for a view of them that holds plain tensors: a leaf alias (``detach``) of each parameter's local
tensor, its ``.grad`` set to the local shard of the parameter's gradient, and each state value's
local shard under that alias. The kernels write into the same memory the ``DTensor``s hold.
State the step creates (at a parameter's first step; after that these optimizers change it in
place) is wrapped back as a ``DTensor`` with its parameter's spec (mesh, placements, shape and
stride), what ``zeros_like`` of the parameter gives torch's optimizer. After the step the
aliases' gradients are dropped, so ``zero_grad`` frees them as before. The view is built at the
first step and again whenever a parameter's local tensor was replaced (the optimized path moves
each shard into its group's storage at the first all-gather) or the optimizer's state was
loaded.
"""

from __future__ import annotations

import operator
import types
from itertools import chain, repeat

import torch
from torch.distributed.tensor import DTensor

# torch's optimizers whose step is elementwise over each parameter and changes its state in
# place once made: over a shard they compute what they compute over the whole, element by
# element. LBFGS (dot products over every parameter) and Adafactor (a matrix's row and column
# means) are not, and neither may be an optimizer of the user's.
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop")
ELEMENTWISE += ("Rprop", "Adadelta", "ASGD")


def local_step(optimizer: torch.optim.Optimizer, elementwise: bool = False):
    """Make ``optimizer.step()`` step the local shards (see the module's docstring); returns
    ``optimizer``. Call it once, after making the optimizer (before or after a scheduler).
    ``optimizer`` must be one of torch's ``ELEMENTWISE`` optimizers, or one whose step is
    elementwise over each parameter and changes a state's tensors in place once made, which
    ``elementwise=True`` says; any other is refused with a ``ValueError``."""
    kind = type(optimizer)
    known = kind in {getattr(torch.optim, name) for name in ELEMENTWISE}
    if not (known or elementwise):
        raise ValueError(
            f"local_step: {kind.__qualname__} is not one of torch's elementwise optimizers "
            f"({', '.join(ELEMENTWISE)}); over local shards a step that reads across a "
            "parameter (norms, dot products, row means) would see only this rank's rows. "
            "Pass elementwise=True if its step is elementwise and changes its state in place."
        )
    if getattr(optimizer, "_twinshard_local_step", None) is not None:
        return optimizer
    stepper = LocalStep(optimizer)

    def step(optimizer, closure=None):
        return stepper.step(closure)

    # a scheduler made before marked the step it wrapped, and warns if the mark is gone; one
    # made after wraps this step as a method of the optimizer, as it does the class's own
    step._wrapped_by_lr_sched = getattr(stepper.inner, "_wrapped_by_lr_sched", False)
    if not step._wrapped_by_lr_sched:
        del step._wrapped_by_lr_sched
    optimizer._twinshard_local_step = stepper
    optimizer.step = types.MethodType(step, optimizer)
    optimizer.register_load_state_dict_post_hook(lambda _: stepper.forget())
    return optimizer


def _local(t: torch.Tensor) -> torch.Tensor:
    # the DTensor's own local tensor: to_local() would make a new autograd view at every call
    return t._local_tensor if isinstance(t, DTensor) else t


class LocalStep:
    """The step of one optimizer over plain tensors, and the view it steps. The per-parameter
    work of a step (is the view still right, the gradients in, the state the step made out)
    runs through ``map`` over lists kept with the view, not a Python loop per parameter."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.inner = optimizer.step  # the step as it is now: a scheduler may have wrapped it
        self.forget()

    def forget(self) -> None:
        """Build the view again at the next step."""
        self.params: list = []  # every parameter, in the param groups' order
        self.plain: list = []  # the plain tensors among them (a parameter FSDP does not hold)
        self.sharded: list = []  # and the DTensor ones
        self.sources: list = []  # the local tensor each of their aliases was made from
        self.aliases: list = []  # the plain tensor the step sees for each of them
        self.groups: list[list] = []  # what the step sees for each param group
        self.state = None  # the view's state, keyed by what the step sees
        self.made: list | None = None  # the view's state dict of each alias, once it has one
        self.seen: list = []  # the ids of their values, as last wrapped back

    def build(self) -> None:
        self.forget()
        state, self.state = self.optimizer.state, _StateView()
        for group in self.optimizer.param_groups:
            seen_as = []
            for p in group["params"]:
                self.params.append(p)
                if not isinstance(p, DTensor):
                    self.plain.append(p)
                    seen_as.append(p)
                    if p in state:
                        self.state[p] = state[p]  # the optimizer's own dict
                    continue
                alias = p._local_tensor.detach()
                if p in state:
                    self.state[alias] = {k: _local(v) for k, v in state[p].items()}
                self.sharded.append(p)
                self.sources.append(p._local_tensor)
                self.aliases.append(alias)
                seen_as.append(alias)
            self.groups.append(seen_as)

    def current(self) -> bool:
        """Whether the view still holds the optimizer's parameters and their local tensors."""
        params = list(chain.from_iterable(map(_PARAMS, self.optimizer.param_groups)))
        return (
            self.state is not None
            and len(params) == len(self.params)
            and all(map(operator.is_, params, self.params))
            and all(map(operator.is_, map(_LOCAL, self.sharded), self.sources))
        )

    def step(self, closure=None):
        optimizer = self.optimizer
        if not self.current():
            self.build()
        try:
            grads = list(map(_LOCAL, map(_GRAD, self.sharded)))
        except AttributeError:  # a parameter without a gradient (None has no local tensor)
            grads = [None if g is None else g._local_tensor for g in map(_GRAD, self.sharded)]
        any(map(setattr, self.aliases, repeat("grad"), grads))  # setattr returns None
        held_groups = [group["params"] for group in optimizer.param_groups]
        held_state, optimizer.state = optimizer.state, self.state
        for group, seen_as in zip(optimizer.param_groups, self.groups):
            group["params"] = seen_as
        try:
            return self.inner(closure)
        finally:
            for group, params in zip(optimizer.param_groups, held_groups):
                group["params"] = params
            optimizer.state = held_state
            any(map(setattr, self.aliases, repeat("grad"), repeat(None)))  # zero_grad frees
            self.wrap_back(held_state)

    def wrap_back(self, state) -> None:
        """Put the state the step made or replaced into ``state``, as ``DTensor``s."""
        for p in self.plain:  # a plain parameter's first state: the optimizer's own dict
            if p not in state and p in self.state:
                state[p] = self.state[p]
        if self.made is None or None in self.made:
            self.made = [self.state.get(alias) for alias in self.aliases]
            self.seen = [None] * len(self.made)
        # how many values each holds: the optimizers of ELEMENTWISE make a parameter's state at
        # its first step and change it in place after that (SGD puts its momentum buffer back
        # at every step, the same tensor)
        seen = [None if d is None else len(d) for d in self.made]
        if seen == self.seen:
            return  # nothing made since the last step: the usual case
        for p, alias, made, ids, was in zip(self.sharded, self.aliases, self.made, seen, self.seen):
            if made is None or ids == was:
                continue
            held = state[p]
            for key, value in made.items():
                if key in held and _local(held[key]) is value:
                    continue
                if isinstance(value, torch.Tensor) and value.shape == alias.shape and value.dim():
                    # laid out as its parameter, it takes the parameter's spec; from_local
                    # would hold a view of it, not it, and be made again at every step
                    value = DTensor.__new__(DTensor, value, p._spec, requires_grad=False)
                held[key] = value
        self.seen = seen


_LOCAL = operator.attrgetter("_local_tensor")
_GRAD = operator.attrgetter("grad")
_PARAMS = operator.itemgetter("params")


class _StateView(dict):
    """The view's state as the optimizer reads it: a parameter it has not stepped gets an empty
    dict, kept (what ``defaultdict(dict)`` does for ``Optimizer.state``)."""

    def __missing__(self, key):
        self[key] = made = {}
        return made
