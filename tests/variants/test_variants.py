"""The communication variants (``variants/``): the quantization by hand, and each variant
under torch's ``fully_shard``, the reference and the optimized path against an exact oracle.

The oracle is the plain model with the variant's declared transform (``variants/transform.py``)
applied where the variant applies it: the weights every rank computes with are the round trip of each rank's padded shard
of each parameter (qwZ); each parameter's reduced gradient is the fp32 sum, in rank order, of
the round trip of every rank's chunk of it (qgZ; by node: the round trip of each node's sum),
or of its bf16 rounding (bf16 wire). A block, scale, layout or order bug moves the numbers off
it; at two ranks the three implementations must also agree bit for bit, since blocks restart at
every parameter ([Note: blocks never cross a parameter] in ``variants/segments.py``).
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn as nn

from twinshard.ranks.launch import launch
from twinshard.variants import Communication, Variant, attach, blocks, fp8, hpz, sent_bytes
from twinshard.variants.segments import Layout

IMPLS = ("torch.distributed.fsdp", "twinshard.reference", "twinshard.optimized")
BLOCK = 8  # small, so that a parameter's shard spans several blocks and ends in a partial one
STEPS = 3
# name -> (ranks, variants); every case runs under each implementation
CASES = {
    "qwz int8": (2, [Variant("qwz", 8, BLOCK)]),
    "qwz int4": (2, [Variant("qwz", 4, BLOCK)]),
    "qgz int8": (2, [Variant("qgz", 8, BLOCK)]),
    "qgz int4": (2, [Variant("qgz", 4, BLOCK)]),
    "bf16 wire": (2, [Variant("bf16-wire")]),
    "qwz + qgz": (2, [Variant("qwz", 8, BLOCK), Variant("qgz", 8, BLOCK)]),
    "qwz + qgz by node, 4 ranks": (4, [Variant("qwz", 8, BLOCK), Variant("qgz", 8, BLOCK, 2)]),
    "fp8": (2, [Variant("fp8")]),
    "fp8 rows + qgz": (2, [Variant("fp8", rows=True), Variant("qgz", 8, BLOCK)]),
}
HPZ = "hpz(2) + qwz, 4 ranks"


def test_int8_blocks_by_hand():
    """[1, -2, 0.5, 0] in one block: scale 2 / 127; codes 1 * 63.5 -> 64 (half to even),
    -127, 31.75 -> 32, 0."""
    codes, scales = blocks.quantize(torch.tensor([1.0, -2.0, 0.5, 0.0]), 8, 4)
    assert codes.tolist() == [64, -127, 32, 0] and scales.tolist() == [pytest.approx(2 / 127)]
    back = blocks.dequantize(codes, scales, 4, 8, 4, torch.float32)
    assert back.tolist() == pytest.approx([64 * 2 / 127, -2.0, 32 * 2 / 127, 0.0])


def test_int4_codes_are_packed_two_to_a_byte():
    """[3, -7, 1.5, 0]: scale 7 / 7 = 1; codes 3, -7, 2 (1.5, half to even), 0; offset by 8:
    11, 1, 10, 8; low nibble first: 11 + 16 * 1 = 27 and 10 + 16 * 8 = 138."""
    codes, scales = blocks.quantize(torch.tensor([3.0, -7.0, 1.5, 0.0]), 4, 4)
    assert codes.dtype == torch.uint8 and codes.tolist() == [27, 138]
    back = blocks.dequantize(codes, scales, 4, 4, 4, torch.float32)
    assert back.tolist() == [3.0, -7.0, 2.0, 0.0]


def test_fp8_codes_by_hand():
    """Tensorwise, [1, -2, 0.3, 0] at one scale, 2 / 448: 1 / s = 224 and -448 are e4m3 values; 0.3 / s
    = 67.2 lies between 64 and 72 (e4m3's step of 8 there), so is sent as 64; 0 as 0."""
    x = torch.tensor([1.0, -2.0, 0.3, 0.0])
    back = fp8.roundtrip(x, rows=False)
    assert back.tolist() == pytest.approx([1.0, -2.0, 64 * 2 / 448, 0.0])
    # by rows, [1, 0.3] at 1 / 448: 0.3 * 448 = 134.4 lies between 128 and 144, sent as 128;
    # the row of zeros at the scale of 1 a zero scale is replaced by
    rows = fp8.roundtrip(torch.tensor([[1.0, 0.3], [0.0, 0.0]]), rows=True)
    assert rows.tolist() == [[1.0, pytest.approx(128 / 448)], [0.0, 0.0]]


def test_a_message_restarts_blocks_at_each_segment_and_counts_its_bytes():
    """Two segments of 5 and 3 values in blocks of 4: 2 + 1 blocks, so 12 code bytes (int8)
    and 12 scale bytes; the last block of each segment is padded, never shared."""
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 100.0, 0.5, 0.25, -1.0])
    message = blocks.pack(x, [5, 3], 8, 4)
    assert message.numel() == blocks.packed_bytes([5, 3], 8, 4) == 24
    back = blocks.unpack(message, [5, 3], 8, 4, torch.float32)
    assert back[:4].tolist() == pytest.approx([1, 2, 3, 4], abs=4 / 127 / 2)
    assert back[4].item() == pytest.approx(100.0)  # its own block: sent exactly
    assert back[5:].tolist() == pytest.approx([0.5, 0.25, -1.0], abs=1 / 127 / 2)
    int4 = blocks.pack(x, [5, 3], 4, 4)
    assert int4.numel() == blocks.packed_bytes([5, 3], 4, 4) == 6 + 12


def test_bad_widths_and_foreign_messages_are_refused_by_name():
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        blocks.quantize(torch.ones(4), 2, 4)
    layout = Layout(nn.Linear(6, 9), "a")  # weight 9 x 6, bias 9: over 2 ranks 30 + 5 values
    assert layout.split(35, 2) == [30, 5] and layout.split(5, 2) == [5]
    with pytest.raises(ValueError, match="module a: a message of 7 values"):
        layout.split(7, 2)
    with pytest.raises(ValueError, match="unknown variant 'qxz'"):
        attach(nn.Linear(2, 2), [Variant("qxz")], None)
    with pytest.raises(ValueError, match="no fully_shard-ed module"):
        attach(nn.Linear(2, 2), [Variant("qwz")], None)


class Net(nn.Module):
    """Linear layers with biases, 9 rows of ``a`` (uneven over 2 and 4 ranks)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 9), nn.Linear(9, 6), nn.Linear(6, 4)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _data(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(4, 6, generator=generator) for _ in range(STEPS)]


def _oracle(variants: list[Variant], ranks: int) -> dict:
    """Losses and final parameters of the plain model with the variants' declared transforms
    (``variants.Communication``: ``gathered``, ``gradient_sum``)."""
    comm = Communication(variants)
    torch.manual_seed(0)
    model = Net()
    params = dict(model.named_parameters())
    momentum = {n: torch.zeros_like(p) for n, p in params.items()}
    losses = []
    for step in range(STEPS):
        seen = {n: comm.gathered(p.detach(), ranks) for n, p in params.items()}
        grads, step_losses = [], []
        for rank in range(ranks):
            leaves = {n: w.clone().requires_grad_() for n, w in seen.items()}
            out = torch.func.functional_call(model, leaves, (_data(rank)[step],))
            loss = out.pow(2).sum()
            loss.backward()
            step_losses.append(loss.item())
            grads.append({n: w.grad for n, w in leaves.items()})
        losses.append(step_losses)
        for n, p in params.items():
            grad = comm.gradient_sum([g[n] for g in grads], ranks) / ranks
            with torch.no_grad():
                momentum[n] = momentum[n] * 0.9 + grad
                p -= 0.1 * momentum[n]
    return {"losses": losses, "params": {n: p.detach() for n, p in params.items()}}


def _run_one(module_name: str, variants: list[Variant], reshard=None, planted=None) -> dict:
    """Train ``Net`` under ``module_name`` with ``variants`` attached (or, ``planted``, one
    broken variant class from ``conformance.planted.lossy`` in int8 with blocks of ``BLOCK``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    impl = importlib.import_module(module_name)
    ranks, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (ranks,))
    torch.manual_seed(0)
    model = Net()
    after = {} if reshard is None else {"reshard_after_forward": reshard}  # None: the root keeps
    for layer in (model.a, model.b):
        impl.fully_shard(layer, mesh=mesh, **after)
    impl.fully_shard(model, mesh=mesh)
    hooks = attach(model, variants, mesh) if planted is None else _attach_planted(model, planted)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x in _data(rank):
        loss = model(x).pow(2).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    shards = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "shards": shards, "sent": sent_bytes(hooks)}


def _attach_planted(model: nn.Module, cls) -> dict:
    from twinshard.variants import fsdp_modules
    from twinshard.variants.qgz import QuantizedReduceScatter

    hooks = {}
    for name, group in fsdp_modules(model):
        hook = cls(Layout(group, name), 8, BLOCK)
        module = group[0] if isinstance(group, list) else group  # a list shares one state
        if isinstance(hook, QuantizedReduceScatter):
            module.set_custom_reduce_scatter(hook)
            hooks[name] = {"reduce_scatter": hook}
        else:
            module.set_custom_all_gather(hook)
            hooks[name] = {"all_gather": hook}
    return hooks


def _run(ranks: int) -> dict:
    out = {}
    for case, (world, variants) in CASES.items():
        if world != ranks:
            continue
        for name in IMPLS:
            try:
                out[case, name] = _run_one(name, variants)
            except Exception as error:  # noqa: BLE001 - reported per case, not as a crash
                out[case, name] = {"error": f"{type(error).__name__}: {error}"}
    if ranks == 4:  # hpZ: nodes of 2, so backward all-gathers within a node
        for name in IMPLS:
            out[HPZ, name] = _run_one(name, [Variant("qwz", 8, BLOCK)], hpz(2))
    return out


_results: dict = {}


def results(ranks: int) -> list[dict]:
    """Every rank's outcomes at ``ranks`` ranks, from one launch shared by the tests."""
    if ranks not in _results:
        _results[ranks] = launch(_run, ranks, ranks)
    return _results[ranks]


@pytest.mark.parametrize("case", list(CASES))
def test_each_variant_matches_its_exact_oracle_under_every_implementation(case):
    ranks, variants = CASES[case]
    oracle = _oracle(variants, ranks)
    by_rank = results(ranks)
    for rank, outcome in enumerate(by_rank):
        for name in IMPLS:
            got = outcome[case, name]
            assert "error" not in got, f"{case} under {name}: {got.get('error')}"
            want = [step[rank] for step in oracle["losses"]]
            losses = torch.tensor(got["losses"])  # float32: the tolerances of the dtype run
            torch.testing.assert_close(losses, torch.tensor(want), msg=f"{case}, {name}: losses")
            for n, shard in got["shards"].items():
                full = oracle["params"][n]
                rows = -(-full.shape[0] // ranks)
                expected = full[rank * rows : (rank + 1) * rows]
                torch.testing.assert_close(shard, expected, msg=f"{case}, {name}: {n}")


@pytest.mark.parametrize("case", [c for c, (ranks, _) in CASES.items() if ranks == 2])
def test_two_ranks_give_the_same_bits_under_every_implementation(case):
    for outcome in results(2):
        first = outcome[case, IMPLS[0]]
        for name in IMPLS[1:]:
            other = outcome[case, name]
            assert other["losses"] == first["losses"], f"{case}: {name} vs torch"
            for n, shard in first["shards"].items():
                assert torch.equal(other["shards"][n], shard), f"{case}: {name} vs torch, {n}"


@pytest.mark.parametrize("case", list(CASES))
def test_the_bytes_sent_are_the_wire_formats(case):
    """Per step and module the all-gather sends each rank's packed shards once (forward and
    backward of the non-root modules, forward only of the root, which keeps them); qgZ's
    all-to-all sends the other ranks' chunks."""
    ranks, variants = CASES[case]
    model = Net()
    pieces = {"a": model.a, "b": model.b, "(root)": model.c}
    for v in variants:
        collective = v.collective
        for name in IMPLS:
            sent = results(ranks)[0][case, name]["sent"][collective]
            if v.kind == "bf16-wire":
                values = sum(
                    sum(_padded(p, ranks) for p in m.parameters()) for m in pieces.values()
                )
                assert sent == STEPS * 2 * values * (ranks - 1), name
                continue
            per_module = {k: _message(m, ranks, v) for k, m in pieces.items()}
            if collective == "all_gather":
                want = STEPS * sum(per_module[k] * (1 if k == "(root)" else 2) for k in per_module)
                assert sent == want, f"{case}, {name}: {sent} bytes, not {want}"
            else:  # flat: S - 1 chunks out; by node: k - 1 rows of every node's, then nodes - 1
                k = v.ranks_per_node if 1 < v.ranks_per_node < ranks else 1
                nodes = ranks // k
                rows = (k - 1) * nodes + nodes - 1 if k > 1 else ranks - 1
                want = STEPS * rows * sum(per_module.values())
                assert sent == want, f"{case}, {name}: {sent} bytes, not {want}"


def _message(module, ranks: int, v: Variant) -> int:
    """One rank's message of ``module``'s parameters under ``v``, as its format is declared:
    blocks of codes with an fp32 scale each, or fp8's code a byte (and rowwise a scale a row,
    for a matrix's rows of p.shape[1] values)."""
    segments = [_padded(p, ranks) for p in module.parameters()]
    if v.kind != "fp8":
        return blocks.packed_bytes(segments, v.bits, v.block)
    rows = [
        n // p.shape[1] if v.rows and p.dim() == 2 else 0
        for n, p in zip(segments, module.parameters())
    ]
    return sum(segments) + 4 * sum(rows)


def _padded(p: torch.Tensor, ranks: int) -> int:
    return -(-p.shape[0] // ranks) * (p.numel() // p.shape[0])


def test_hpz_gathers_backward_within_a_node_under_every_implementation():
    """hpZ with qwZ at 4 ranks in nodes of 2: forward gathers each block's quantized shards
    from 4 ranks; after forward a rank keeps its node's two 4-rank shards of the dequantized
    weights, and backward gathers those from the node's 2 ranks in fp32, unquantized; the root
    keeps its parameters, so gathers once. Backward computes with forward's weights: qwZ's
    oracle holds, under every implementation."""
    model = Net()
    layers = (model.a, model.b)
    quantized = sum(
        blocks.packed_bytes([_padded(p, 4) for p in m.parameters()], 8, BLOCK)
        for m in (*layers, model.c)
    )
    kept = sum(2 * _padded(p, 4) * 4 for m in layers for p in m.parameters())  # fp32
    oracle = _oracle([Variant("qwz", 8, BLOCK)], 4)
    for rank, outcome in enumerate(results(4)):
        for name in IMPLS:
            got = outcome[HPZ, name]
            assert got["sent"]["all_gather"] == STEPS * (quantized + kept), name
            want = torch.tensor([step[rank] for step in oracle["losses"]])
            torch.testing.assert_close(torch.tensor(got["losses"]), want, msg=name)
            for n, shard in got["shards"].items():
                rows = -(-oracle["params"][n].shape[0] // 4)
                expected = oracle["params"][n][rank * rows : (rank + 1) * rows]
                torch.testing.assert_close(shard, expected, msg=f"{name}: {n}")
