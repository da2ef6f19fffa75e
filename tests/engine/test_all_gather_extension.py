"""FSDP2's all-gather extension (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``,
``reference/more/extension.py``) under torch's ``fully_shard``, the reference and the optimized path.

One launch of two gloo ranks trains the same small model under each implementation with
extensions of three kinds, set on each weight's local shard after ``fully_shard`` (the form
that works without a subclass of one's own):

- ``bf16``: gathers a bf16 copy of an fp32 shard and casts it back (a quantized all-gather);
  rows that do not divide over the ranks are padded by the extension.
- ``int8``: gathers two tensors of different dtypes, int8 rows and one fp32 scale per row
  (what a float8 weight does with its bytes and its scale), under a bf16 ``param_dtype``.
- ``two``: ``TwoTensor`` weights gathering their two inner tensors; their gradients are
  ``TwoTensor`` too, and are reduced as plain tensors, as torch's are.

Each run must give torch's numbers bit for bit (losses, every rank's shards), call the
extension as often as torch does, and free what the unsharded weight is made of when it
reshards. Refused by name, on every rank, at the first unshard that meets them: a subclass
weight without the extension, inputs that are not padded blocks where the rows do not divide,
and an extension set after the weight's first all-gather (twinshard only: torch's
``fully_shard`` raises an AttributeError from its internals for the last, and for the second
it raises on the ranks that pad while the others wait in the all-gather).
"""

from __future__ import annotations

import importlib
import re

import pytest
import torch
import torch.nn as nn

from twinshard.ranks.launch import launch

IMPLS = ("torch.distributed.fsdp", "twinshard.reference", "twinshard.optimized")
KINDS = ("bf16", "int8", "two")


class Net(nn.Module):
    """Three bias-free linear layers whose weights have ``hidden``, 6 and 4 rows (9 rows do not
    divide over two ranks)."""

    def __init__(self, hidden: int = 9):
        super().__init__()
        self.a, self.b = nn.Linear(6, hidden, bias=False), nn.Linear(hidden, 6, bias=False)
        self.c = nn.Linear(6, 4, bias=False)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _padded(t: torch.Tensor, mesh, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to this rank's share of ``rows`` (ceil(rows / ranks))."""
    chunk = -(-rows // mesh.size())
    return torch.cat([t, t.new_zeros((chunk - t.shape[0], *t.shape[1:]))])


def _extension(kind: str, calls: list):
    """The (pre, post) pair of ``kind``, counting the pre-all-gather calls in ``calls``."""
    from torch.testing._internal.two_tensor import TwoTensor

    def pre(self, mesh, outer_size, outer_stride, module, mp_policy):
        calls.append(mesh.size())
        if kind == "two":
            return (
                _padded(self.a, mesh, outer_size[0]),
                _padded(self.b, mesh, outer_size[0]),
            ), None
        if kind == "bf16":
            return (_padded(self.to(torch.bfloat16), mesh, outer_size[0]),), None
        scale = self.abs().amax(dim=1, keepdim=True).clamp(min=1e-6) / 127  # (rows, 1)
        data = torch.round(self / scale).to(torch.int8)  # (rows, cols)
        return (_padded(data, mesh, outer_size[0]), _padded(scale, mesh, outer_size[0])), None

    def post(self, outputs, metadata, param_dtype, *, out=None):
        if kind == "two":
            whole = TwoTensor(*outputs)
        elif kind == "bf16":
            whole = outputs[0]
        else:
            whole = outputs[0].to(torch.float32) * outputs[1]
        whole = whole.to(param_dtype)
        if out is not None:  # ``.data``: writing the values is no change autograd must see
            rows = out.shape[0]  # ``out`` has the parameter's shape: no padding rows
            if kind == "two":
                out.a.data.copy_(whole.a[:rows])
                out.b.data.copy_(whole.b[:rows])
            else:
                out.data.copy_(whole[:rows])
            return None
        inner = outputs if kind == "two" else (*outputs, whole)
        return whole, inner

    return pre, post


def _model(impl, kind: str, calls: list) -> nn.Module:
    from torch.testing._internal.two_tensor import TwoTensor

    torch.manual_seed(0)
    # Rows that do not divide (9) for bf16 only: int8's scale per row cannot have the padded
    # block's shape, which torch's fully_shard asks of every input then, and torch's gathers
    # of an uneven TwoTensor do not match in size across ranks.
    model = Net(hidden=9 if kind == "bf16" else 8)
    if kind == "two":
        for layer in (model.a, model.b, model.c):
            layer.weight = nn.Parameter(TwoTensor(layer.weight, layer.weight.clone() * 0.5))
    mp = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16) if kind == "int8" else None
    for layer in (model.a, model.b):
        impl.fully_shard(layer, mp_policy=mp or impl.MixedPrecisionPolicy())
    impl.fully_shard(model, mp_policy=mp or impl.MixedPrecisionPolicy())
    _set_extension(model, kind, calls)
    return model


def _set_extension(model: nn.Module, kind: str, calls: list, only: str = "") -> None:
    pre, post = _extension(kind, calls)
    for name, param in model.named_parameters():
        if not name.startswith(only):
            continue
        local = param._local_tensor  # the shard: set the methods on this very tensor
        local.fsdp_pre_all_gather = pre.__get__(local)
        local.fsdp_post_all_gather = post.__get__(local)


def _inner(t: torch.Tensor) -> list[torch.Tensor]:
    return [t.a.clone(), t.b.clone()] if hasattr(t, "a") else [t.clone()]


def _run_one(module_name: str, kind: str) -> dict:
    impl = importlib.import_module(module_name)
    calls: list = []
    model = _model(impl, kind, calls)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(torch.distributed.get_rank())
    losses = []
    for _ in range(3):
        loss = model(torch.randn(4, 6, generator=generator)).float().pow(2).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    model.a.unshard()  # explicitly, to see the memory of the unsharded weight
    whole = model.a.weight  # the unsharded parameter, while unsharded
    made_of = [whole.a, whole.b] if kind == "two" else [whole]  # its memory, not a copy
    held = [t.untyped_storage().nbytes() for t in made_of]
    model.a.reshard()
    freed = [t.untyped_storage().nbytes() for t in made_of]
    shards = {n: _inner(p._local_tensor) for n, p in model.named_parameters()}
    return {"losses": losses, "shards": shards, "calls": calls, "held": held, "freed": freed}


def _refused(module_name: str, misuse: str) -> str | None:
    """The error of a forward: ``subclass``, a TwoTensor weight without the extension;
    ``uneven``, the int8 extension on a weight of 9 rows (its scale is not of the padded block's
    shape); ``late``, the bf16 extension set after a forward. Under twinshard only."""
    from torch.testing._internal.two_tensor import TwoTensor

    impl = importlib.import_module(module_name)
    model = Net()
    if misuse == "subclass":
        model.b.weight = nn.Parameter(TwoTensor(model.b.weight, model.b.weight.clone()))
    impl.fully_shard(model)
    if misuse == "late":
        model(torch.randn(2, 6))
        model.reshard()  # the root keeps its parameters after forward
    if misuse in ("uneven", "late"):
        _set_extension(model, "int8" if misuse == "uneven" else "bf16", [], only="a.")
    try:
        model(torch.randn(2, 6))
    except Exception as error:  # noqa: BLE001 - the type is what is checked
        return f"{type(error).__name__}: {error}"
    return None


def _run() -> dict:
    out = {}
    for name in IMPLS:
        for kind in KINDS:
            try:
                out[name, kind] = _run_one(name, kind)
            except Exception as error:  # noqa: BLE001 - reported per case, not as a crash
                out[name, kind] = {"error": f"{type(error).__name__}: {error}"}
        if name != IMPLS[0]:
            for misuse in ("subclass", "uneven", "late"):
                out[name, misuse] = _refused(name, misuse)
    return out


_results: list = []


def results() -> list[dict]:
    """Every rank's outcomes, from one launch shared by the tests."""
    if not _results:
        _results.extend(launch(_run, 2))
    return _results


@pytest.mark.parametrize("kind", KINDS)
def test_torch_runs_the_extension(kind):
    """The control: torch's run of each kind trains and calls the extension."""
    for out in results():
        theirs = out[IMPLS[0], kind]
        assert "error" not in theirs, theirs
        assert theirs["calls"] and all(size == 2 for size in theirs["calls"])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", IMPLS[1:])
def test_extension_gives_torch_numbers_bit_for_bit(name, kind):
    for out in results():
        mine, theirs = out[name, kind], out[IMPLS[0], kind]
        assert "error" not in mine, mine
        assert mine["losses"] == theirs["losses"]
        assert mine["shards"].keys() == theirs["shards"].keys()
        for param, tensors in theirs["shards"].items():
            for a, b in zip(mine["shards"][param], tensors, strict=True):
                assert torch.equal(a, b), (param, a, b)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", IMPLS[1:])
def test_extension_is_called_and_freed_as_torch_does(name, kind):
    for out in results():
        mine, theirs = out[name, kind], out[IMPLS[0], kind]
        assert len(mine["calls"]) == len(theirs["calls"]), (mine["calls"], theirs["calls"])
        assert all(size == 2 for size in mine["calls"])  # the shard group's 1D mesh
        assert all(held > 0 for held in mine["held"]), mine["held"]
        assert mine["freed"] == theirs["freed"] == [0] * len(theirs["freed"])


MISUSES = {  # what each misuse's FSDPUsageError must say, on every rank
    "subclass": r"'b\.weight' of Linear is a TwoTensor, a tensor subclass without "
    r"fsdp_pre_all_gather",
    "uneven": r"'a\.weight' of shape \(9, 6\) .* padded to \(5, 6\); it returned "
    r"\[\([45], 6\), \([45], 1\)\]",
    "late": r"'a\.weight' got fsdp_pre_all_gather after its first all-gather",
}


@pytest.mark.parametrize("misuse", MISUSES)
@pytest.mark.parametrize("name", IMPLS[1:])
def test_misuse_is_refused_by_name_on_every_rank(name, misuse):
    for out in results():
        raised = out[name, misuse]
        assert raised is not None and raised.startswith("FSDPUsageError"), raised
        assert re.search(MISUSES[misuse], raised), raised
