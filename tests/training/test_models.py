"""Unit tests for twinshard.models."""

import math

import pytest
import torch
from torch import nn

from twinshard.models import (
    Llama,
    LlamaConfig,
    MLPBlock,
    MLPStack,
    TransformerBlock,
    apply_rope,
    rope_tables,
)

UNEVEN = dict(vocab_size=37, dim=24, n_layers=2, n_heads=3, ffn_hidden=37, max_seq_len=16)


def _assert_same_params(a: nn.Module, b: nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert pa[name].device.type == "cpu"
        assert torch.equal(pa[name], pb[name]), name


# ----------------------------------------------------------------------------- MLP


def test_mlp_stack_uneven_shapes():
    m = MLPStack(dim=15, hidden=37, n_blocks=3, in_dim=7, out_dim=5)
    assert isinstance(m.blocks, nn.ModuleList) and len(m.blocks) == 3
    assert all(isinstance(b, MLPBlock) for b in m.blocks)
    assert m.blocks[0].w1.weight.shape == (37, 15)
    y = m(torch.randn(4, 7))
    assert y.shape == (4, 5)
    y3 = m(torch.randn(2, 3, 7))
    assert y3.shape == (2, 3, 5)


def test_mlp_stack_defaults_and_no_bias():
    m = MLPStack()
    assert m.proj_in is None
    assert m(torch.randn(2, 15)).shape == (2, 15)
    nb = MLPStack(dim=15, hidden=37, n_blocks=2, bias=False)
    linears = [mod for mod in nb.modules() if isinstance(mod, nn.Linear)]
    assert len(linears) == 5 and all(mod.bias is None for mod in linears)


def test_mlp_block_is_residual():
    blk = MLPBlock(15, 37)
    with torch.no_grad():
        blk.w2.weight.zero_()
        blk.w2.bias.zero_()
    x = torch.randn(3, 15)
    assert torch.equal(blk(x), x)


def test_mlp_backward_reaches_every_parameter():
    m = MLPStack(dim=15, hidden=37, n_blocks=2, in_dim=7)
    m(torch.randn(4, 7)).pow(2).mean().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_mlp_init_weights_values_and_determinism():
    a = MLPStack(dim=15, hidden=37, n_blocks=2, in_dim=7)
    b = MLPStack(dim=15, hidden=37, n_blocks=2, in_dim=7)
    a.init_weights(seed=3)
    b.init_weights(seed=3)
    _assert_same_params(a, b)
    assert torch.equal(a.norm.weight, torch.ones(15))
    assert torch.equal(a.blocks[0].w1.bias, torch.zeros(37))
    w = a.blocks[0].w1.weight
    assert abs(w.std().item() - 0.02) < 0.005 and abs(w.mean().item()) < 0.005
    b.init_weights(seed=4)
    assert not torch.equal(a.head.weight, b.head.weight)


def test_construction_follows_manual_seed():
    torch.manual_seed(11)
    a = MLPStack(dim=15, hidden=37, in_dim=7)
    torch.manual_seed(11)
    b = MLPStack(dim=15, hidden=37, in_dim=7)
    _assert_same_params(a, b)
    torch.manual_seed(11)
    la = Llama(LlamaConfig(**UNEVEN))
    torch.manual_seed(11)
    lb = Llama(LlamaConfig(**UNEVEN))
    _assert_same_params(la, lb)


def test_mlp_meta_then_to_empty_matches_cpu():
    with torch.device("meta"):
        meta = MLPStack(dim=15, hidden=37, n_blocks=3, in_dim=7)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    meta.init_weights(seed=0)
    cpu = MLPStack(dim=15, hidden=37, n_blocks=3, in_dim=7)
    cpu.init_weights(seed=0)
    _assert_same_params(meta, cpu)


# --------------------------------------------------------------------------- Llama


def test_llama_uneven_logits_shape():
    cfg = LlamaConfig(**UNEVEN)
    assert cfg.head_dim == 8 and cfg.hidden_dim == 37
    m = Llama(cfg)
    assert isinstance(m.blocks, nn.ModuleList) and len(m.blocks) == 2
    assert all(isinstance(b, TransformerBlock) for b in m.blocks)
    assert m.blocks[0].feed_forward.w1.weight.shape == (37, 24)
    tokens = torch.randint(0, 37, (2, 11))
    logits = m(tokens)
    assert logits.shape == (2, 11, 37)
    assert torch.isfinite(logits).all()


def test_llama_loss_scalar_and_backward():
    m = Llama(LlamaConfig(**UNEVEN))
    tokens = torch.randint(0, 37, (2, 9))
    targets = torch.randint(0, 37, (2, 9))
    loss = m(tokens, targets)
    assert loss.dim() == 0 and torch.isfinite(loss)
    # Near-uniform predictions at init: loss close to log(vocab).
    assert abs(loss.item() - math.log(37)) < 0.5
    expected = torch.nn.functional.cross_entropy(m(tokens).reshape(-1, 37), targets.reshape(-1))
    assert torch.allclose(loss, expected)
    loss.backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert m.blocks[0].attention.wq.weight.grad.abs().sum() > 0


def test_llama_is_causal():
    m = Llama(LlamaConfig(**UNEVEN))
    tokens = torch.randint(0, 37, (1, 10))
    changed = tokens.clone()
    changed[0, 6:] = (changed[0, 6:] + 1) % 37
    a, b = m(tokens), m(changed)
    assert torch.allclose(a[:, :6], b[:, :6], atol=1e-6)
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_llama_gqa_shapes():
    cfg = LlamaConfig(vocab_size=37, dim=24, n_heads=6, n_kv_heads=2, ffn_hidden=37)
    m = Llama(cfg)
    attn = m.blocks[0].attention
    assert attn.wq.weight.shape == (24, 24)
    assert attn.wk.weight.shape == (8, 24) and attn.wv.weight.shape == (8, 24)
    assert m(torch.randint(0, 37, (2, 5))).shape == (2, 5, 37)


def test_default_ffn_hidden_rounding():
    assert LlamaConfig(dim=64).hidden_dim == 192  # int(8*64/3)=170 -> 192
    assert LlamaConfig(dim=24, n_heads=3, multiple_of=1).hidden_dim == 64
    assert LlamaConfig(dim=30, n_heads=3, multiple_of=1).hidden_dim == 80
    assert LlamaConfig(dim=30, n_heads=3, multiple_of=7).hidden_dim == 84


def test_rope_is_relative_and_norm_preserving():
    cos, sin = rope_tables(8, 6, 10000.0)
    assert cos.shape == (8, 3)
    x = torch.randn(1, 8, 2, 6)
    r = apply_rope(x, cos, sin)
    assert torch.allclose(r.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert torch.allclose(r[:, 0], x[:, 0])  # position 0 is not rotated
    # Same vector at every position: dot products depend only on the offset.
    q = torch.randn(6).expand(1, 8, 1, 6)
    rq = apply_rope(q, cos, sin)[0, :, 0]  # (T, D)
    assert torch.allclose(rq[1] @ rq[3], rq[4] @ rq[6], atol=1e-5)


def test_tied_embeddings_share_one_parameter():
    m = Llama(LlamaConfig(**UNEVEN, tie_embeddings=True))
    assert m.output.weight is m.tok_embeddings.weight
    untied = Llama(LlamaConfig(**UNEVEN))
    assert len(list(m.parameters())) == len(list(untied.parameters())) - 1
    assert m.num_params() == untied.num_params() - 37 * 24
    loss = m(torch.randint(0, 37, (2, 5)), torch.randint(0, 37, (2, 5)))
    loss.backward()
    assert m.tok_embeddings.weight.grad is not None


def test_tied_embeddings_survive_meta_to_empty():
    with torch.device("meta"):
        m = Llama(LlamaConfig(**UNEVEN, tie_embeddings=True))
    m.to_empty(device="cpu")
    m.init_weights(seed=0)
    assert m.output.weight is m.tok_embeddings.weight
    assert not m.output.weight.is_meta


def test_state_dict_holds_only_parameters():
    m = Llama(LlamaConfig(**UNEVEN))
    keys = set(m.state_dict())
    assert keys == {n for n, _ in m.named_parameters()}
    assert not any("freq" in k or "rope" in k or "cos" in k or "sin" in k for k in keys)
    assert list(m.buffers()) == []


@pytest.mark.parametrize("tie", [False, True])
def test_llama_meta_then_to_empty_matches_cpu(tie):
    cfg = LlamaConfig(**UNEVEN, tie_embeddings=tie)
    with torch.device("meta"):
        meta = Llama(cfg)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    meta.init_weights(seed=0)
    cpu = Llama(cfg)
    cpu.init_weights(seed=0)
    _assert_same_params(meta, cpu)
    tokens = torch.randint(0, 37, (2, 7))
    assert torch.equal(meta(tokens), cpu(tokens))


def test_llama_init_weights_values():
    m = Llama(LlamaConfig(**UNEVEN))
    m.init_weights(seed=1)
    assert torch.equal(m.norm.weight, torch.ones(24))
    assert torch.equal(m.blocks[1].ffn_norm.weight, torch.ones(24))
    w = m.tok_embeddings.weight
    assert abs(w.std().item() - 0.02) < 0.004
    before = m.output.weight.clone()
    m.init_weights(seed=1)
    assert torch.equal(m.output.weight, before)
    m.init_weights(seed=2)
    assert not torch.equal(m.output.weight, before)


def test_reset_parameters_on_submodules_is_valid():
    with torch.device("meta"):
        m = Llama(LlamaConfig(**UNEVEN))
    m.to_empty(device="cpu")
    count = 0
    for mod in m.modules():
        if hasattr(mod, "reset_parameters"):
            mod.reset_parameters()
            count += 1
    assert count >= 1 + 2 * (2 + 7) + 2  # embedding, per-block norms+linears, norm, output
    assert all(torch.isfinite(p).all() for p in m.parameters())
    assert torch.isfinite(m(torch.randint(0, 37, (1, 4)))).all()


def test_sequence_longer_than_max_raises():
    m = Llama(LlamaConfig(**UNEVEN))
    with pytest.raises(ValueError, match="max_seq_len"):
        m(torch.randint(0, 37, (1, 17)))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dim=30, n_heads=4), "divisible by n_heads"),
        (dict(dim=24, n_heads=6, n_kv_heads=4), "divisible by n_kv_heads"),
        (dict(dim=24, n_heads=4, n_kv_heads=8), "divisible by n_kv_heads"),
        (dict(dim=15, n_heads=5), "even"),
    ],
)
def test_bad_head_configs_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**kwargs)


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError) as err:
        LlamaConfig.preset("huge")
    msg = str(err.value)
    assert "huge" in msg
    for name in ("tiny", "small", "medium", "1b"):
        assert name in msg
    with pytest.raises(ValueError, match="not_a_field"):
        LlamaConfig.preset("tiny", not_a_field=1)


@pytest.mark.parametrize(
    "name, lo, hi",
    [
        ("tiny", 5e4, 3e5),
        ("small", 5e6, 2e7),
        ("medium", 5e7, 2e8),
        ("1b", 1.0e9, 1.3e9),
    ],
)
def test_preset_param_counts(name, lo, hi):
    with torch.device("meta"):
        m = Llama(LlamaConfig.preset(name))
    n = m.num_params()
    assert lo <= n <= hi, n
    assert n == sum(p.numel() for p in m.parameters())


def test_preset_overrides_and_tiny_forward():
    cfg = LlamaConfig.preset("tiny", n_layers=1, tie_embeddings=True)
    assert cfg.dim == 64 and cfg.n_layers == 1 and cfg.tie_embeddings
    assert LlamaConfig.preset("1b").n_kv_heads == 8
    m = Llama(cfg)
    assert len(m.blocks) == 1
    assert m(torch.randint(0, 256, (2, 8))).shape == (2, 8, 256)
