"""A Hugging Face ``transformers`` causal-LM config file as a ``twinshard.models.LlamaConfig``.

``llama_config(path)`` reads the ``config.json`` of a Llama-architecture model (``model_type``
llama or mistral: RMSNorm, rotary embeddings, grouped-query attention without biases, a
SwiGLU feed-forward) with ``json`` alone, so a plan needs neither ``transformers`` nor the
weights. The fields it maps:

    vocab_size, hidden_size (dim), num_hidden_layers, num_attention_heads,
    num_key_value_heads, intermediate_size (ffn_hidden), rms_norm_eps, rope_theta,
    tie_word_embeddings, max_position_embeddings

A file that is not such a config gets one ``ValueError`` naming the file, what is wrong and
what to do (a model with attention biases, for example, is not this architecture).
"""

from __future__ import annotations

import json
import os

from twinshard.models import LlamaConfig

SUPPORTED = ("llama", "mistral")
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def looks_like_file(model: str) -> bool:
    """Whether ``--model`` names a file (a path) rather than a preset."""
    return model.endswith(".json") or os.sep in model


def llama_config(path: str, **overrides) -> LlamaConfig:
    """The ``LlamaConfig`` of the HF config file ``path`` (see the module docstring)."""
    where = f"--model {path}"
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file; give a preset or a config.json") from None
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{where}: not a readable JSON config ({error})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: a config.json holds one object; this file does not")
    kind = raw.get("model_type")
    if kind not in SUPPORTED:
        raise ValueError(
            f"{where}: model_type {kind!r} is not a Llama-architecture model; the plan builds "
            f"{', '.join(SUPPORTED)} configs (use a preset otherwise)"
        )
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ValueError(f"{where}: biases in attention or MLP are not this architecture")
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    if head_dim * heads != raw["hidden_size"]:
        raise ValueError(f"{where}: head_dim {head_dim} x {heads} heads != hidden_size")
    fields = dict(
        vocab_size=raw["vocab_size"],
        dim=raw["hidden_size"],
        n_layers=raw["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=raw.get("num_key_value_heads") or heads,
        ffn_hidden=raw.get("intermediate_size"),
        norm_eps=raw.get("rms_norm_eps", 1e-5),
        rope_theta=raw.get("rope_theta", 10000.0),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_seq_len=raw.get("max_position_embeddings", 2048),
    )
    fields.update(overrides)
    try:
        return LlamaConfig(**fields)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
