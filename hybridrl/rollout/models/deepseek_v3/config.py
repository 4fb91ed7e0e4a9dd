"""The DeepSeek-V3 part of a model config: multi-head latent attention and DeepSeekMoE.

transformers' ``DeepseekV3Config`` (``model_type: deepseek_v3``; DeepSeek-V3/V3.1/R1,
Kimi-K2, Moonlight) read into the engine's ``ModelConfig`` plus two blocks of its own:

- :class:`MlaDims`: q-LoRA rank (None: a plain ``q_proj``), the latent ``kv_lora_rank``,
  the per-head widths (``qk_nope_head_dim + qk_rope_head_dim`` for q/k, ``v_head_dim`` for
  v), the interleaved RoPE flag, and the two numbers YaRN folds in: the softmax scale
  (``qk_head_dim^-0.5 * mscale(factor, mscale_all_dim)^2``, transformers'
  ``yarn_apply_mscale``) and the cos/sin ``attention_factor``. The inverse frequencies come
  from transformers' own ``ROPE_INIT_FUNCTIONS`` on the config, so YaRN is theirs exactly.
- :class:`GroupedRouter`: sigmoid scores, ``e_score_correction_bias`` for selection only,
  ``n_group`` / ``topk_group`` group-limited top-k, ``routed_scaling_factor``.

Every inconsistency is one ``ValueError`` naming the config key, raised here, before any
module is built.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "yarn")
SUPPORTED_SCORING = ("sigmoid",)
SUPPORTED_TOPK_METHODS = ("noaux_tc",)


@dataclass(frozen=True)
class MlaDims:
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float
    rope_attention_factor: float
    """YaRN's attention_factor: transformers multiplies cos and sin by it (1.0 otherwise)."""
    rope_inv_freq: tuple[float, ...]
    """[qk_rope_head_dim // 2] inverse frequencies (float32 values), transformers' own."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class GroupedRouter:
    n_group: int
    topk_group: int
    routed_scaling_factor: float


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def _bad(key: str, value: Any, why: str) -> ValueError:
    return ValueError(f"deepseek_v3 config: {key}={value!r} {why}")


def _hf_config(cfg: Any):
    """A transformers ``DeepseekV3Config`` for ``cfg`` (a dict is turned into one)."""
    if not isinstance(cfg, dict):
        return cfg
    from transformers import AutoConfig

    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    return AutoConfig.for_model("deepseek_v3", **fields)


def _rope(hf: Any, rope_dim: int) -> tuple[dict[str, Any], tuple[float, ...], float]:
    params = dict(_get(hf, "rope_parameters") or _get(hf, "rope_scaling") or {})
    params.setdefault("rope_theta", _get(hf, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise _bad("rope_parameters.rope_type", kind, f"is not supported by the rollout engine for "
                   f"deepseek_v3; use one of {SUPPORTED_ROPE_TYPES}")
    params["rope_type"] = kind
    if kind == "default":
        base = float(params["rope_theta"])
        import torch

        inv = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim))
        return params, tuple(inv.tolist()), 1.0
    for key in ("factor", "original_max_position_embeddings"):
        if params.get(key) is None:
            raise _bad(f"rope_parameters.{key}", None, "is required for rope_type 'yarn'; set it")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    return params, tuple(inv.float().tolist()), float(attention_factor)


def _softmax_scale(params: dict[str, Any], qk_head_dim: int) -> float:
    """transformers' ``yarn_apply_mscale``: the mscale_all_dim correction, squared."""
    scale = qk_head_dim ** -0.5
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        factor = float(params["factor"])
        m = 1.0 if factor <= 1 else 0.1 * float(params["mscale_all_dim"]) * math.log(factor) + 1.0
        scale = scale * m * m
    return scale


def _positive(cfg: Any, key: str) -> int:
    value = _get(cfg, key)
    if not isinstance(value, int) or value <= 0:
        raise _bad(key, value, "must be a positive integer")
    return value


def parse_deepseek_v3(cfg: Any, model_config_cls):
    """``cfg`` (a ``DeepseekV3Config`` or its dict) -> ``model_config_cls(...)`` (a ``ModelConfig``)."""
    hf = _hf_config(cfg)
    heads, hidden = _positive(hf, "num_attention_heads"), _positive(hf, "hidden_size")
    kv_heads = _get(hf, "num_key_value_heads") or heads
    if kv_heads != heads:
        raise _bad("num_key_value_heads", kv_heads, f"must equal num_attention_heads={heads} for "
                   "multi-head latent attention (every head reads the shared latent)")
    nope, rope_dim = _positive(hf, "qk_nope_head_dim"), _positive(hf, "qk_rope_head_dim")
    v_dim, kv_rank = _positive(hf, "v_head_dim"), _positive(hf, "kv_lora_rank")
    if rope_dim % 2:
        raise _bad("qk_rope_head_dim", rope_dim, "must be even (RoPE rotates pairs)")
    qk_head_dim = _get(hf, "qk_head_dim")
    if qk_head_dim is not None and qk_head_dim != nope + rope_dim:
        raise _bad("qk_head_dim", qk_head_dim, f"must equal qk_nope_head_dim + qk_rope_head_dim = "
                   f"{nope} + {rope_dim}; fix the head dims")
    head_dim = _get(hf, "head_dim")
    if head_dim is not None and head_dim != rope_dim:
        raise _bad("head_dim", head_dim, f"must equal qk_rope_head_dim={rope_dim} (transformers' rotary "
                   "embedding reads head_dim); fix the head dims")
    q_rank = _get(hf, "q_lora_rank")
    if q_rank is not None and (not isinstance(q_rank, int) or q_rank <= 0):
        raise _bad("q_lora_rank", q_rank, "must be a positive integer or null (a plain q_proj)")
    act = _get(hf, "hidden_act", "silu")
    if act != "silu":
        raise _bad("hidden_act", act, "is not supported by the rollout engine; only 'silu'")
    scoring = _get(hf, "scoring_func", "sigmoid")
    if scoring not in SUPPORTED_SCORING:
        raise _bad("scoring_func", scoring, f"is not supported for deepseek_v3 (transformers' "
                   f"DeepseekV3TopkRouter scores with a sigmoid); use one of {SUPPORTED_SCORING}")
    topk_method = _get(hf, "topk_method", "noaux_tc")
    if topk_method not in SUPPORTED_TOPK_METHODS:
        raise _bad("topk_method", topk_method, f"is not supported; use one of {SUPPORTED_TOPK_METHODS}")
    rope, inv_freq, attention_factor = _rope(hf, rope_dim)
    mla = MlaDims(q_lora_rank=q_rank, kv_lora_rank=kv_rank, qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim,
                  v_head_dim=v_dim, rope_interleave=bool(_get(hf, "rope_interleave", True)),
                  softmax_scale=_softmax_scale(rope, nope + rope_dim),
                  rope_attention_factor=attention_factor, rope_inv_freq=inv_freq)
    num_layers = _positive(hf, "num_hidden_layers")
    moe = _moe(hf, num_layers)
    attention_bias = bool(_get(hf, "attention_bias", False))
    return model_config_cls(
        model_type="deepseek_v3", vocab_size=_positive(hf, "vocab_size"), hidden_size=hidden,
        intermediate_size=_positive(hf, "intermediate_size"), num_layers=num_layers, num_heads=heads,
        num_kv_heads=heads, head_dim=nope + rope_dim, rms_norm_eps=float(_get(hf, "rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(_get(hf, "tie_word_embeddings", False)), qkv_bias=attention_bias,
        o_bias=attention_bias, mlp_bias=False, qk_norm=False, rope=rope, mla=mla, **moe)


def _moe(hf: Any, num_layers: int) -> dict[str, Any]:
    experts = int(_get(hf, "n_routed_experts", 0) or 0)
    first_dense = int(_get(hf, "first_k_dense_replace", 0) or 0)
    layers = tuple(range(min(first_dense, num_layers), num_layers)) if experts else ()
    if not layers:
        return {}
    top_k = _get(hf, "num_experts_per_tok")
    n_group, topk_group = int(_get(hf, "n_group", 1) or 1), int(_get(hf, "topk_group", 1) or 1)
    if experts % n_group:
        raise _bad("n_group", n_group, f"must divide n_routed_experts={experts}")
    if experts // n_group < 2:
        raise _bad("n_group", n_group, f"leaves {experts // n_group} expert per group; a group's score "
                   "is the sum of its top-2 experts, so each group needs at least 2")
    if not 0 < topk_group <= n_group:
        raise _bad("topk_group", topk_group, f"must be in [1, n_group={n_group}]")
    if not isinstance(top_k, int) or not 0 < top_k <= topk_group * (experts // n_group):
        raise _bad("num_experts_per_tok", top_k, f"must be in [1, topk_group * experts per group = "
                   f"{topk_group * (experts // n_group)}]")
    moe_width = _positive(hf, "moe_intermediate_size")
    shared = _get(hf, "n_shared_experts")
    if not isinstance(shared, int) or shared <= 0:
        raise _bad("n_shared_experts", shared, "must be a positive integer (transformers' DeepseekV3MoE "
                   "always has shared experts, of width moe_intermediate_size * n_shared_experts)")
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_width,
                norm_topk_prob=bool(_get(hf, "norm_topk_prob", True)), moe_layers=layers,
                shared_expert_intermediate_size=moe_width * shared,
                router=GroupedRouter(n_group=n_group, topk_group=topk_group,
                                     routed_scaling_factor=float(_get(hf, "routed_scaling_factor", 1.0))))
