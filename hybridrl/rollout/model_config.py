"""What the rollout model needs from a Hugging Face config, parsed and validated once.

Supports the Llama, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm) families. RoPE
parameters are read from `config.rope_parameters` (transformers 5) or
`config.rope_scaling` + `config.rope_theta` (transformers 4).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    """per-head width; Qwen3 may set it independently of hidden_size / num_heads."""
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    """Qwen3: RMSNorm over head_dim on q and k before RoPE."""
    rope: dict[str, Any] = field(default_factory=dict)
    """rope_type, rope_theta and the type's extra keys (factor, low_freq_factor, ...)."""


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def _rope_params(cfg: Any) -> dict[str, Any]:
    params = _get(cfg, "rope_parameters") or _get(cfg, "rope_scaling") or {}
    params = dict(params)
    if "rope_theta" not in params:
        params["rope_theta"] = _get(cfg, "rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} in the model config is not supported by the rollout "
            f"engine; supported: {SUPPORTED_ROPE_TYPES}"
        )
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 in the model config is not supported by the rollout engine")
    params["rope_type"] = rope_type
    return params


def parse_hf_config(cfg: Any) -> ModelConfig:
    """Read a transformers config object (or its `to_dict()`) into a `ModelConfig`."""
    model_type = _get(cfg, "model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported by the rollout engine; "
            f"use a config of one of {SUPPORTED_MODEL_TYPES}"
        )
    if _get(cfg, "use_sliding_window", False):
        raise ValueError("use_sliding_window=True is not supported by the rollout engine; set it to False")
    hidden, heads = _get(cfg, "hidden_size"), _get(cfg, "num_attention_heads")
    head_dim = _get(cfg, "head_dim") or hidden // heads
    attention_bias = bool(_get(cfg, "attention_bias", False))
    return ModelConfig(
        model_type=model_type,
        vocab_size=_get(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_get(cfg, "intermediate_size"),
        num_layers=_get(cfg, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=_get(cfg, "num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=model_type != "qwen2" and attention_bias,
        mlp_bias=bool(_get(cfg, "mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        rope=_rope_params(cfg),
    )
