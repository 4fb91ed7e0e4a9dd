"""What the rollout model needs from a Hugging Face config, parsed and validated once.

Supports the Llama, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm) families, their
mixture-of-experts variants Qwen3-MoE and Qwen2-MoE (with its shared expert), and
DeepSeek-V3 (multi-head latent attention + DeepSeekMoE; its fields: ``models/deepseek_v3/config.py``).
RoPE parameters are read from `config.rope_parameters` (transformers 5) or
`config.rope_scaling` + `config.rope_theta` (transformers 4).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridrl.rollout.models.deepseek_v3.config import GroupedRouter, MlaDims
    from hybridrl.rollout.models.deepseek_v4.config import V4Dims
    from hybridrl.rollout.models.vision_language.config import VlDims

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "deepseek_v3", "deepseek_v4",
                         "qwen2_5_vl", "qwen3_vl")
VL_MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl")
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")
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
    # -- mixture of experts (num_experts == 0: dense) --
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    """renormalize the top-k router probabilities to sum to 1 (Qwen3-MoE checkpoints: True)."""
    moe_layers: tuple[int, ...] = ()
    """indices of the sparse (MoE) layers; the others have a dense MLP of intermediate_size.
    HF rule: i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    shared_expert_intermediate_size: int = 0
    """width of the always-on shared expert(s); 0 = none. Qwen2-MoE gates it by
    sigmoid(shared_expert_gate); DeepSeek's ``shared_experts`` are ungated."""
    # -- DeepSeek-V3 (None: the Llama/Qwen attention and softmax router) --
    mla: "MlaDims | None" = None
    """multi-head latent attention dimensions (``models/deepseek_v3/config.py``)."""
    router: "GroupedRouter | None" = None
    """DeepSeekMoE's sigmoid, group-limited router (``models/deepseek_v3/config.py``)."""
    v4: "V4Dims | None" = None
    """DeepSeek-V4's dimensions (``models/deepseek_v4/config.py``); its state cache is ``models/deepseek_v4/state.py``."""
    vl: "VlDims | None" = None
    """Qwen2.5-VL / Qwen3-VL: the vision side (``models/vision_language/config.py``); the
    fields above are then the language model's (its ``text_config``)."""

    def is_moe_layer(self, idx: int) -> bool:
        return idx in self.moe_layers

    @property
    def kv_layout(self) -> tuple[tuple[str, int, int], ...]:
        """What the KV cache holds per token and layer: ``(name, heads, width)`` per tensor.
        GQA: k and v, ``num_kv_heads`` heads of ``head_dim``; MLA: one latent of
        ``kv_lora_rank + qk_rope_head_dim`` values shared by every head."""
        if self.mla is not None:
            return (("latent", 1, self.mla.kv_lora_rank + self.mla.qk_rope_head_dim),)
        return (("k", self.num_kv_heads, self.head_dim), ("v", self.num_kv_heads, self.head_dim))


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
    if rope_type == "mrope":  # Qwen2-VL-era configs name mRoPE's (default) frequencies "mrope"
        rope_type = "default"
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
    if model_type == "deepseek_v3":
        from hybridrl.rollout.models.deepseek_v3.config import parse_deepseek_v3

        return parse_deepseek_v3(cfg, ModelConfig)
    if model_type == "deepseek_v4":
        from hybridrl.rollout.models.deepseek_v4.config import v4_model_config

        return v4_model_config(cfg, ModelConfig)
    if model_type in VL_MODEL_TYPES:
        from hybridrl.rollout.models.vision_language.config import parse_vision_language

        return parse_vision_language(cfg, _parse_decoder)
    return _parse_decoder(cfg, model_type)


def _parse_decoder(cfg: Any, model_type: str) -> ModelConfig:
    """A Llama / Qwen2 / Qwen3 (-MoE) decoder config read as ``model_type``."""
    if _get(cfg, "use_sliding_window", False):
        raise ValueError("use_sliding_window=True is not supported by the rollout engine; set it to False")
    act = _get(cfg, "hidden_act", "silu")
    if act != "silu":  # the decoder's MLPs and experts are SwiGLU: silu(gate) * up
        raise ValueError(f"hidden_act={act!r} in the {model_type} config is not supported by the rollout engine "
                         "(its MLPs compute silu(gate) * up); only 'silu'")
    hidden, heads = _get(cfg, "hidden_size"), _get(cfg, "num_attention_heads")
    head_dim = _get(cfg, "head_dim") or hidden // heads
    attention_bias = bool(_get(cfg, "attention_bias", False))
    qkv_bias = (attention_bias or model_type == "qwen2"
                or (model_type == "qwen2_moe" and bool(_get(cfg, "qkv_bias", True))))
    num_layers = _get(cfg, "num_hidden_layers")
    moe = _moe_fields(cfg, model_type, num_layers) if model_type in MOE_MODEL_TYPES else {}
    return ModelConfig(
        model_type=model_type,
        vocab_size=_get(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_get(cfg, "intermediate_size"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=_get(cfg, "num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=model_type not in ("qwen2", "qwen2_moe") and attention_bias,
        mlp_bias=bool(_get(cfg, "mlp_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        rope=_rope_params(cfg),
        **moe,
    )


def _moe_fields(cfg: Any, model_type: str, num_layers: int) -> dict[str, Any]:
    """The MoE part of a Qwen3-MoE / Qwen2-MoE config, validated."""
    num_experts = int(_get(cfg, "num_experts", 0) or 0)
    top_k = int(_get(cfg, "num_experts_per_tok", 0) or 0)
    step = int(_get(cfg, "decoder_sparse_step", 1) or 1)
    mlp_only = set(_get(cfg, "mlp_only_layers", None) or ())
    layers = tuple(i for i in range(num_layers)
                   if i not in mlp_only and num_experts > 0 and (i + 1) % step == 0)
    if layers and not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
    shared = int(_get(cfg, "shared_expert_intermediate_size", 0) or 0) if model_type == "qwen2_moe" else 0
    return dict(num_experts=num_experts, num_experts_per_tok=top_k,
                moe_intermediate_size=int(_get(cfg, "moe_intermediate_size")),
                norm_topk_prob=bool(_get(cfg, "norm_topk_prob", False)), moe_layers=layers,
                shared_expert_intermediate_size=shared)


def kv_bytes_per_token(hf_config: Any, element_size: int) -> int:
    """KV-cache bytes one token takes in the built-in engine (every layer): ``kv_layout``'s
    widths — 2 x KV heads x head_dim for GQA, ``kv_lora_rank + qk_rope_head_dim`` for MLA."""
    cfg = parse_hf_config(hf_config)
    if cfg.v4 is not None:  # what grows with context: the compressed entries (models/deepseek_v4/state.py)
        d = cfg.v4
        per = {"compressed_sparse_attention": (d.head_dim + d.index_head_dim) / d.csa_rate,
               "heavily_compressed_attention": d.head_dim / d.hca_rate}
        return int(round(sum(per.get(t, 0.0) for t in d.layer_types) * element_size))
    return cfg.num_layers * sum(heads * width for _, heads, width in cfg.kv_layout) * element_size
