"""``F.linear`` for the rollout engine on CPU: oneDNN's inner product for large weights.

Why: decode at small batch is a chain of matrix-vector products bound by how fast the
weights stream from memory, and torch's default CPU BLAS (MKL) runs ``F.linear`` with one
row on one thread whatever ``torch.set_num_threads`` says. oneDNN's inner product (the
kernel torch's own CPU compiler emits for linears, ``torch.ops.mkldnn._linear_pointwise``)
takes the same row-major ``[N, K]`` weight in place — no repacked copy, so refit still
writes the one storage the engine reads — and threads it. Measured on 2 cores, float32,
the small benchmark model (32000 x 512 lm_head, 8 layers of 512 / 1408 widths): one
decode step's linears 13.5 ms -> 8.6 ms at batch 1; the lm_head 1.7x faster at batch 64.
It costs a fixed ~30 us per call, so small weights (the tiny models) keep ``F.linear``.

Numerics: a different summation order, so results differ from ``F.linear`` in the last
bits (the engine's 1e-4 agreement with transformers is tested through both paths).
Falls back to ``F.linear`` where oneDNN is unavailable or rejects a dtype (bf16 without
AVX512-BF16 on this CPU: it is probed once per dtype), under autograd, and off CPU.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

USE_ONEDNN = True  # switch: False forces F.linear (tests run both)
ONEDNN_MIN_WEIGHT_ELEMENTS = 1 << 18  # 512 x 512; below, the per-call overhead outweighs the gain


@functools.cache
def _onednn_serves(dtype: torch.dtype) -> bool:
    """Whether oneDNN's inner product runs here for ``dtype`` (and agrees with F.linear)."""
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
    if op is None:
        return False
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=g).to(dtype) for shape in ((3, 64), (48, 64), (48,)))
    try:
        with torch.inference_mode():
            y = op(x, w, b, "none", [], "")
    except RuntimeError:  # e.g. "could not create a primitive descriptor" for bf16 without ISA support
        return False
    return bool(torch.allclose(y.float(), F.linear(x, w, b).float(), rtol=1e-2, atol=1e-2))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x ``[..., K]``, weight ``[N, K]``, bias ``[N]`` -> ``[..., N]``."""
    if (USE_ONEDNN and x.device.type == "cpu" and weight.numel() >= ONEDNN_MIN_WEIGHT_ELEMENTS
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and x.dtype == weight.dtype and _onednn_serves(weight.dtype)):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
