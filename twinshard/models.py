"""Small example models for tests, tutorials and the training CLI.

Two model families live here, both built so that ``fully_shard`` can be applied
to every entry of ``model.blocks`` (an ``nn.ModuleList``) and then to the root:

* ``MLPStack``: an optional input projection, a stack of residual ``MLPBlock``
  layers (LayerNorm -> Linear -> GELU -> Linear), a final LayerNorm and a head.
  Every width is a constructor argument, so deliberately uneven sizes (7, 15, 37)
  exercise the padding paths of a sharding implementation.
* ``Llama``: a compact Llama-style decoder (RMSNorm, rotary position embedding,
  grouped-query causal attention, SwiGLU feed-forward) configured by
  ``LlamaConfig``, with named presets from ``"tiny"`` up to ``"1b"``.

Both models have ``init_weights(seed=None)``, which rewrites every parameter in
place: normal(0, 0.02) for Linear and Embedding weights, ones for norm weights
and zeros for biases. Values are drawn on the CPU in float32 and then copied, so
the same seed gives bit-identical weights on any device and for a model that was
built on the ``meta`` device and materialized with ``to_empty``. With
``seed=None`` the global RNG is used, so ``torch.manual_seed`` controls it.

The rotary tables are computed in ``forward`` from the sequence length; nothing
but parameters ends up in ``state_dict``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

INIT_STD = 0.02


def init_weights_(model: nn.Module, seed: int | None = None) -> None:
    """Deterministically re-initialize every parameter of ``model`` in place."""
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    seen: set[int] = set()  # tied parameters are initialized once
    with torch.no_grad():
        for module in model.modules():
            for name, p in module.named_parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                if name == "bias":
                    p.zero_()
                elif isinstance(module, (nn.Linear, nn.Embedding)):
                    if p.is_meta:
                        continue  # nothing to fill yet; init again after to_empty
                    vals = torch.empty(p.shape, dtype=torch.float32)
                    p.copy_(vals.normal_(0.0, INIT_STD, generator=gen))
                else:  # LayerNorm / RMSNorm weights
                    p.fill_(1.0)


# ----------------------------------------------------------------------------- MLP


class MLPBlock(nn.Module):
    """Residual MLP block: ``x + w2(gelu(w1(norm(x))))``."""

    def __init__(self, dim: int, hidden: int, bias: bool = True):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.w1(self.norm(x)))  # (..., hidden)
        return x + self.w2(h)  # (..., dim)


class MLPStack(nn.Module):
    """``proj_in`` (optional) -> ``blocks`` -> ``norm`` -> ``head``."""

    def __init__(
        self,
        dim: int = 15,
        hidden: int = 37,
        n_blocks: int = 3,
        in_dim: int | None = None,
        out_dim: int | None = None,
        bias: bool = True,
    ):
        super().__init__()
        self.proj_in = nn.Linear(in_dim, dim, bias=bias) if in_dim is not None else None
        self.blocks = nn.ModuleList(MLPBlock(dim, hidden, bias) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, dim if out_dim is None else out_dim, bias=bias)
        self.init_weights()

    def init_weights(self, seed: int | None = None) -> None:
        """Re-initialize all parameters (see the module docstring)."""
        init_weights_(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.proj_in is not None:
            x = self.proj_in(x)  # (..., dim)
        for block in self.blocks:
            x = block(x)  # (..., dim)
        return self.head(self.norm(x))  # (..., out_dim)


# --------------------------------------------------------------------------- Llama

PRESETS = {
    "tiny": dict(vocab_size=256, dim=64, n_layers=2, n_heads=4),
    "small": dict(vocab_size=8192, dim=256, n_layers=8, n_heads=8, n_kv_heads=4),
    "medium": dict(vocab_size=8192, dim=768, n_layers=12, n_heads=12, max_seq_len=1024),
    "1b": dict(
        vocab_size=32000,
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=8192,
        max_seq_len=2048,
    ),
}


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # < n_heads means grouped-query attention
    ffn_hidden: int | None = None  # None: int(8 * dim / 3) rounded up to multiple_of
    multiple_of: int = 32
    max_seq_len: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.n_heads <= 0 or self.dim % self.n_heads != 0:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"head_dim = dim // n_heads = {self.head_dim} must be even for rotary embeddings"
            )
        if self.multiple_of < 1:
            raise ValueError(f"multiple_of must be >= 1, got {self.multiple_of}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """The SwiGLU hidden width actually used."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        m = self.multiple_of
        return m * math.ceil(int(8 * self.dim / 3) / m)

    @classmethod
    def preset(cls, name: str, **overrides) -> LlamaConfig:
        """A named configuration ("tiny", "small", "medium", "1b") with overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; valid names: {', '.join(PRESETS)}")
        valid = {f.name for f in fields(cls)}
        bad = set(overrides) - valid
        if bad:
            raise ValueError(f"unknown LlamaConfig fields: {sorted(bad)}")
        return cls(**{**PRESETS[name], **overrides})


def rope_tables(seq_len: int, head_dim: int, theta: float, device=None):
    """cos and sin tables, each (seq_len, head_dim // 2), in float32."""
    inv_freq = theta ** (
        -torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    )  # (head_dim/2,)
    pos = torch.arange(seq_len, device=device, dtype=torch.float32)  # (T,)
    angles = torch.outer(pos, inv_freq)  # (T, head_dim/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs of x (B, T, H, D) by position-dependent angles."""
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]  # (B, T, H, D/2)
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, D/2)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (B, T, H, D/2, 2)
    return out.flatten(-2).type_as(x)  # (B, T, H, D)


class Attention(nn.Module):
    """Causal multi-head attention with rotary embeddings and grouped KV heads."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)  # (B, T, n_heads, head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, n_kv_heads, head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, n_kv_heads, head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, head_dim)
        if self.n_kv_heads != self.n_heads:
            rep = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(rep, dim=1)  # (B, n_heads, T, head_dim)
            v = v.repeat_interleave(rep, dim=1)  # (B, n_heads, T, head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, n_heads, T, head_dim)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, n_heads * head_dim)
        return self.wo(y)  # (B, T, dim)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, dim)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention then feed-forward."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.hidden_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)  # (B, T, dim)
        return x + self.feed_forward(self.ffn_norm(x))  # (B, T, dim)


class Llama(nn.Module):
    """Token embedding -> ``blocks`` -> RMSNorm -> output projection."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.blocks = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()

    def init_weights(self, seed: int | None = None) -> None:
        """Re-initialize all parameters (see the module docstring)."""
        if self.config.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight  # restore a tie lost in a move
        init_weights_(self, seed)

    def num_params(self) -> int:
        """Number of distinct parameter elements (a tied weight counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = tokens.shape
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.config.max_seq_len}")
        cfg = self.config
        cos, sin = rope_tables(T, cfg.head_dim, cfg.rope_theta, tokens.device)  # (T, head_dim/2)
        h = self.tok_embeddings(tokens)  # (B, T, dim)
        for block in self.blocks:
            h = block(h, cos, sin)  # (B, T, dim)
        logits = self.output(self.norm(h))  # (B, T, vocab)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())  # scalar
