"""The DeepSeek-V4 part of a model config (transformers' ``DeepseekV4Config``), validated.

Issue #32 (``docs/design/deepseek_v4_plan.md``), in progress: the engine runs it
(``models/deepseek_v4/model.py``, state in ``models/deepseek_v4/state.py``) for unquantized rollout weights.

:class:`V4Dims` holds what the V4 modules read; every inconsistency is one ``ValueError``
naming the key. transformers ignores some fields (``num_key_value_heads``: one shared K=V
head; ``n_shared_experts``: one shared MLP; ``norm_topk_prob``: always renormalized) and
silently truncates a too-long ``layer_types``; the engine requires the values its model
actually runs and checks the raw lengths.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
MLP_LAYER_TYPES = ("hash_moe", "moe")
SCORING = ("sqrtsoftplus", "sigmoid")  # transformers 5.19 cannot build "softmax" (no ACT2FN entry)
COMPRESS_ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True)
class V4Dims:
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    sliding_window: int
    csa_rate: int
    hca_rate: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    main_inv_freq: tuple[float, ...]
    compress_inv_freq: tuple[float, ...]
    main_attention_factor: float
    compress_attention_factor: float


def _bad(key: str, value: Any, why: str) -> ValueError:
    return ValueError(f"deepseek_v4 config: {key}={value!r} {why}")


def _positive(cfg: Any, key: str) -> int:
    value = getattr(cfg, key, None)
    if not isinstance(value, int) or value <= 0:
        raise _bad(key, value, "must be a positive integer")
    return value


def _inv_freq(cfg: Any, label: str, rope_dim: int) -> tuple[tuple[float, ...], float]:
    params = cfg.rope_parameters[label]
    kind = params.get("rope_type", "default")
    if kind == "default":
        import torch

        base = float(params["rope_theta"])
        inv = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim))
        return tuple(inv.tolist()), 1.0
    if label != "compress" or kind not in COMPRESS_ROPE_TYPES:
        raise _bad(f"rope_parameters.{label}.rope_type", kind, f"is not supported; the main rope is 'default', "
                   f"the compress rope one of {COMPRESS_ROPE_TYPES}")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, factor = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", layer_type=label)
    return tuple(inv.float().tolist()), float(factor)


def parse_deepseek_v4(cfg: Any, raw: dict[str, Any] | None = None) -> V4Dims:
    """``cfg``: a transformers ``DeepseekV4Config``; ``raw``: its ``config.json`` fields when
    known (``layer_types`` there are checked before transformers' truncation)."""
    n = _positive(cfg, "num_hidden_layers")
    for key, allowed in (("layer_types", LAYER_TYPES), ("mlp_layer_types", MLP_LAYER_TYPES)):
        types = (raw or {}).get(key) or getattr(cfg, key)
        if len(types) != n:
            raise _bad(key, f"<{len(types)} entries>", f"must have num_hidden_layers={n} entries")
        bad = sorted(set(types) - set(allowed))
        if bad:
            raise _bad(key, bad[0], f"is not a DeepSeek-V4 {key[:-1].replace('_', ' ')}; use {allowed}")
    if getattr(cfg, "num_key_value_heads", 1) != 1:
        raise _bad("num_key_value_heads", cfg.num_key_value_heads, "must be 1 (V4 reads one shared K=V head)")
    if getattr(cfg, "n_shared_experts", 1) != 1:
        raise _bad("n_shared_experts", cfg.n_shared_experts, "must be 1 (V4 has one shared MLP)")
    if cfg.scoring_func not in SCORING:
        raise _bad("scoring_func", cfg.scoring_func, f"is not supported; use one of {SCORING}")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise _bad("hidden_act", cfg.hidden_act, "is not supported; only 'silu'")
    heads, head_dim = _positive(cfg, "num_attention_heads"), _positive(cfg, "head_dim")
    rope_dim, index_dim = int(cfg.qk_rope_head_dim), _positive(cfg, "index_head_dim")
    if rope_dim <= 0 or rope_dim % 2 or rope_dim > head_dim or rope_dim > index_dim:
        raise _bad("partial_rotary_factor", cfg.partial_rotary_factor,
                   f"gives a rope slice of {rope_dim}; it must be even, > 0 and <= head_dim={head_dim} and "
                   f"index_head_dim={index_dim}")
    groups = _positive(cfg, "o_groups")
    if heads * head_dim % groups:
        raise _bad("o_groups", groups, f"must divide num_attention_heads * head_dim = {heads * head_dim}")
    experts, top_k = _positive(cfg, "n_routed_experts"), _positive(cfg, "num_experts_per_tok")
    if top_k > experts:
        raise _bad("num_experts_per_tok", top_k, f"must be <= n_routed_experts={experts}")
    rates = cfg.compress_rates
    main, main_factor = _inv_freq(cfg, "main", rope_dim)
    compress, compress_factor = _inv_freq(cfg, "compress", rope_dim)
    return V4Dims(
        head_dim=head_dim, rope_dim=rope_dim, q_lora_rank=_positive(cfg, "q_lora_rank"), o_groups=groups,
        o_lora_rank=_positive(cfg, "o_lora_rank"), hc_mult=_positive(cfg, "hc_mult"),
        hc_sinkhorn_iters=_positive(cfg, "hc_sinkhorn_iters"), hc_eps=float(cfg.hc_eps),
        sliding_window=_positive(cfg, "sliding_window"), csa_rate=int(rates["compressed_sparse_attention"]),
        hca_rate=int(rates["heavily_compressed_attention"]), index_n_heads=_positive(cfg, "index_n_heads"),
        index_head_dim=index_dim, index_topk=_positive(cfg, "index_topk"), layer_types=tuple(cfg.layer_types),
        mlp_layer_types=tuple(cfg.mlp_layer_types), scoring_func=cfg.scoring_func,
        routed_scaling_factor=float(cfg.routed_scaling_factor), swiglu_limit=float(cfg.swiglu_limit),
        main_inv_freq=main, compress_inv_freq=compress, main_attention_factor=main_factor,
        compress_attention_factor=compress_factor)


def v4_model_config(cfg: Any, model_config_cls, raw: dict[str, Any] | None = None):
    """``model_config_cls(...)`` (a ``ModelConfig``) of a ``DeepseekV4Config``; its ``v4``
    field is the :class:`V4Dims`."""
    dims = parse_deepseek_v4(cfg, raw)
    n = cfg.num_hidden_layers
    model = model_config_cls(
        model_type="deepseek_v4", vocab_size=_positive(cfg, "vocab_size"), hidden_size=_positive(cfg, "hidden_size"),
        intermediate_size=_positive(cfg, "moe_intermediate_size"), num_layers=n,
        num_heads=cfg.num_attention_heads, num_kv_heads=1, head_dim=dims.head_dim,
        rms_norm_eps=float(cfg.rms_norm_eps), tie_word_embeddings=bool(cfg.tie_word_embeddings), qkv_bias=False,
        o_bias=False, mlp_bias=False, qk_norm=False, num_experts=cfg.n_routed_experts,
        num_experts_per_tok=cfg.num_experts_per_tok, moe_intermediate_size=cfg.moe_intermediate_size,
        norm_topk_prob=True, moe_layers=tuple(range(n)), v4=dims)
    return model
