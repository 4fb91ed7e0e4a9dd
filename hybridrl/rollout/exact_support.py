"""Where the built-in engine runs batch-invariant (``EngineSpec.exact``, ``rollout.exact``).

Its exact layers compute, op for op, what the trainer's transformers modules compute under
``hybridrl.exact`` (``layers/exact_linear.py``, the exact paths of the norms, the rotary
tables, the attention and the sampler). That is written for the dense decoders (Llama,
Qwen2, Qwen3: GQA attention, biases, q/k norms, tied or untied heads), their MoE variants
(Qwen2-MoE, Qwen3-MoE, DeepSeekMoE), DeepSeek-V3's latent attention, LoRA adapters (peft's
forward) and the vision-language models (Qwen2.5-VL, Qwen3-VL: transformers' own vision tower
run under ``hybridrl.exact`` on both sides, the mRoPE tables on the SIMD path), in full precision, one engine per data-parallel rank. Everything else is refused
here in one line; ``pipeline/engines.py`` then samples with the trainer's own modules instead
(``hybridrl/exact/engine.py``), which holds for the families listed there.
"""

from __future__ import annotations

from hybridrl.rollout.layers.tensor_parallel import SINGLE, TensorParallel


def exact_refusal(config, spec, tensor_parallel: TensorParallel = SINGLE) -> str | None:
    """Why the built-in engine cannot run ``config`` (a parsed ``ModelConfig``) under ``spec``
    batch-invariantly, or None when it can."""
    if config.v4 is not None:
        return "DeepSeek-V4 layers have no batch-invariant kernels in the built-in engine yet"
    if spec.quantization is not None:
        return f"quantized rollout weights ({spec.quantization}) are not the trainer's weights"
    if tensor_parallel.size > 1:
        return "tensor-parallel ranks split the reductions the trainer runs whole"
    return None
