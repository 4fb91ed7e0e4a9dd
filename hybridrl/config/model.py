"""The ``model`` group: which policy to train (a built-in tiny model or a local checkpoint),
its sizes and dtype, and its LoRA adapters (``model.lora``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridrl.config.base import ConfigError, Range, _f, check_ranges

VL_ARCHS = ("qwen2_5_vl", "qwen3_vl")  # vision-language: a vision tower + a Qwen language model
BUILTIN_ARCHS = ("qwen2", "deepseek_v3", "deepseek_v4", *VL_ARCHS)


# every family's attention and MLP projections: Qwen2/Llama/Qwen3 (q/k/v/o), DeepSeek-V3
# MLA (q or q_a/q_b, kv_a_proj_with_mqa, o; kv_b_proj is left out: the engine folds it into
# the absorbed attention caches), DeepSeek-V4 (q_a/q_b, kv, o_b), and dense / shared-expert
# MLPs; an entry a model lacks is skipped (peft's rule)
DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                        "kv_proj", "o_b_proj", "gate_proj", "up_proj", "down_proj"]
LORA_INITS = ("zeros", "gaussian")


@dataclass(kw_only=True)
class LoRAConfig:
    rank: int = _f(0, "LoRA rank of the RL policy's adapters (peft); 0 = full fine-tuning", check=Range(low=0))
    alpha: float = _f(16.0, "LoRA alpha: the adapter's output is scaled by alpha / rank",
                      check=Range(low=0, low_open=True))
    dropout: float = _f(0.0, "dropout on the adapters' input in the trainer (the engine never drops)",
                        check=Range(low=0, high=1))
    target_modules: list[str] = _f(list(DEFAULT_LORA_TARGETS),
                                   "nn.Linear modules that get adapters: name suffixes as peft matches them "
                                   "(attention and dense / shared-expert MLP projections by default; MoE routed "
                                   "experts are fused 3-D parameters, never targeted)")
    init: str = _f("zeros", "adapter init, B = 0 in both (the policy starts as the base): zeros (A Kaiming-"
                            "uniform, peft's default) | gaussian (A ~ N(0, 1/rank))")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def __post_init__(self) -> None:
        check_ranges(self, "model.lora")
        if self.init not in LORA_INITS:
            raise ConfigError(f"model.lora.init={self.init!r}: use one of {', '.join(LORA_INITS)}")
        if self.rank and (not self.target_modules or not all(isinstance(t, str) and t for t in self.target_modules)):
            raise ConfigError(f"model.lora.target_modules={self.target_modules!r}: give a non-empty list of module "
                              "name suffixes, e.g. [q_proj, v_proj]")


@dataclass(kw_only=True)
class ModelConfig:
    path: str | None = _f(None, "local Hugging Face checkpoint dir (model + tokenizer); None = built-in tiny model")
    arch: str = _f("qwen2", "built-in model's family: qwen2 (GQA, dense) | deepseek_v3 (multi-head latent "
                            "attention + DeepSeekMoE, the DeepSeek-V3/R1, Kimi-K2 architecture) | deepseek_v4 "
                            "(compressed sparse attention, hyper-connections; rollout routing replay not yet) | "
                            "qwen2_5_vl / qwen3_vl (vision-language: a small vision tower, patch 14 / 16, "
                            "merge 2, and a Qwen2 / Qwen3 language model of these sizes)")
    hidden_size: int = _f(128, "built-in model: hidden size", check=Range(low=1))
    num_hidden_layers: int = _f(2, "built-in model: decoder layers", check=Range(low=1))
    num_attention_heads: int = _f(4, "built-in model: attention heads", check=Range(low=1))
    num_key_value_heads: int = _f(2, "built-in model: KV heads (GQA)", check=Range(low=1))
    intermediate_size: int = _f(512, "built-in model: MLP width", check=Range(low=1))
    # Untied by default: with a 19-token vocabulary, tying makes every lm_head update move
    # the operand embeddings too; measured, untied reaches 98% after the same warm start
    # that gets a tied model to 61%.
    tie_word_embeddings: bool = _f(False, "built-in model: share the input embedding and lm_head")
    dtype: str = _f("float32", "trainer dtype: float32 | bfloat16")
    freeze_vision: bool = _f(False, "vision-language models: keep the vision tower (and its merger) fixed: no "
                                    "gradient, not in the optimizer (verl's freeze_vision_tower; default trains it)")
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    @property
    def is_vision_language(self) -> bool:
        """The built-in arch is a vision-language model (a checkpoint's kind comes from its config)."""
        return self.arch in VL_ARCHS

    @property
    def torch_dtype(self):
        """``dtype`` as a ``torch.dtype`` (torch imported on first use: configs stay light)."""
        import torch

        return getattr(torch, self.dtype)

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"model.dtype={self.dtype!r} is not supported; use float32 or bfloat16")
        if self.arch not in BUILTIN_ARCHS:
            raise ConfigError(f"model.arch={self.arch!r} is not a built-in model; use one of {BUILTIN_ARCHS} "
                              "(or model.path for a checkpoint)")
        check_ranges(self, "model")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("model.num_attention_heads must be a multiple of model.num_key_value_heads")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError("model.hidden_size must be a multiple of model.num_attention_heads")
