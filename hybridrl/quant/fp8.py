"""FP8 (e4m3fn) weight quantization into preallocated tensors, in place.

Two granularities for a linear weight ``w [N, K]`` (N output rows, K input columns):

- per-output-channel: ``scale [N, 1]`` float32, ``w[n, :] ≈ q[n, :] * scale[n]``;
- 128×128 blocks: ``scale [ceil(N/128), ceil(K/128)]`` float32, one scale per tile;
  edge tiles may be partial.

Why in place: the FP8 weight and its scale are the tensors a captured CUDA graph reads.
Refit must write *into* them (``copy_``), never allocate replacements. Every function
here takes its output tensors as arguments and never rebinds them.

Numerics. ``scale = amax / 448`` with ``amax`` the largest |w| of the row / tile (zero
rows get ``scale = TINY / 448``), so the scaled values ``y = w / scale`` lie in
[-448, 448] and the cast to e4m3fn rounds to nearest-even without saturating (a clamp
guards the fp32 rounding of the division). e4m3fn has 3 mantissa bits: for normal
``|y| >= 2**-6`` the rounding error is at most half an ulp, ``2**-4 * |y|``; below it the
subnormal spacing is ``2**-9``, so at most ``2**-10``. Scaling back multiplies by
``scale``, so elementwise ``|dequant(w) - w| <= 2**-4 |w| + 2**-10 scale`` (plus fp32
rounding of the divide and multiply, covered by a ``2**-20 |w|`` slack term). That is
``abs_error_bound``; the refit verifier and the tests use it. ``dequantize_`` rounds once
more into the output dtype (bf16: a further ``2**-8`` relative), which the callers add.

Work is done in stripes of ``BLOCK`` rows so the float32 temporary is ``128 × K``, not
the whole weight: refit's peak extra memory stays one bucket plus the largest tensor.

On CPU, :func:`quantize_` and :func:`dequantize_` run the fused one-pass kernels of
:mod:`hybridrl.quant.native` when they could be built (bitwise the same results, 5-10x
faster); the torch stripe loop below is the reference and the fallback.

On a GPU (any non-CPU source) the same arithmetic runs *vectorized*: chunks of up to
``DEVICE_CHUNK_ELEMENTS`` (whole 128-row tiles), each a handful of kernels over the whole
chunk, with the block scales taken on a ``[rows/128, 128, K/128, 128]`` view — instead of
~6 launches per 128-row stripe from Python (10^4-10^5 launches for a 7B refit). Every
element goes through the same float32 ops (an amax is exact; the divide and multiply are
elementwise), so the results are bitwise those of the stripe loop (tested on CPU); the
float32 temporary is bounded by the chunk (64 MiB), not the weight.
"""
from __future__ import annotations

import math

import torch

from hybridrl.quant import native

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
BLOCK = 128  # tile edge of block quantization (DeepSeek-V3 style 128×128)
TINY = 1e-12  # amax floor so an all-zero row / tile gets a finite, nonzero scale
ROWS_PER_STRIPE = BLOCK  # rows quantized per float32 temporary (CPU / reference path)
DEVICE_CHUNK_ELEMENTS = 1 << 24  # vectorized (GPU) path: elements per float32 temporary, 64 MiB


def block_scale_shape(n_rows: int, n_cols: int) -> tuple[int, int]:
    """Shape of the 128×128 block-scale tensor for an ``[n_rows, n_cols]`` weight."""
    return (math.ceil(n_rows / BLOCK), math.ceil(n_cols / BLOCK))


def _check(src: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: bool):
    """Explicit checks (not asserts: they must hold under ``python -O`` too, since the
    native kernels index with these shapes)."""
    if src.dim() != 2 or src.shape != weight.shape:
        raise ValueError(f"quantize_: src {tuple(src.shape)} and weight {tuple(weight.shape)} must be the same [N, K]")
    if weight.dtype != FP8_DTYPE or scale.dtype != torch.float32:
        raise ValueError(f"quantize_: weight must be {FP8_DTYPE} and scale float32, got {weight.dtype}, {scale.dtype}")
    _check_scale_shape("quantize_", weight, scale, block)


def _check_scale_shape(fn: str, weight: torch.Tensor, scale: torch.Tensor, block: bool) -> None:
    want = block_scale_shape(*weight.shape) if block else (weight.shape[0], 1)
    if tuple(scale.shape) != want:
        raise ValueError(f"{fn}: scale has shape {tuple(scale.shape)}, expected {want} for a "
                         f"{tuple(weight.shape)} weight ({'128x128 blocks' if block else 'per channel'})")


def quantize_(src: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *, block: bool,
              pow2: bool = False) -> None:
    """Quantize ``src [N, K]`` (any float dtype) into ``weight [N, K]`` fp8 and ``scale`` in place.

    ``scale`` is ``[N, 1]`` (per channel) or ``block_scale_shape(N, K)`` (block). For block
    quantization ``weight`` must start on a 128-row tile boundary of its scale (callers pass
    row slices of a fused weight whose shard offsets are multiples of 128).

    ``pow2``: every scale rounded up to a power of two, ``2**ceil(log2(amax / 448))`` — the
    ``ue8m0`` scales of DeepSeek-V3.1/V4 checkpoints (storable as one E8M0 byte). Values then
    survive a dequantize -> quantize round trip exactly (a power-of-two rescale of e4m3 codes
    that stay within +-448), so a shipped checkpoint re-quantizes to its own values.
    """
    _check(src, weight, scale, block)
    if not pow2 and _quantize_native(src, weight, scale, block):
        return
    if src.device.type != "cpu":
        _quantize_vectorized(src, weight, scale, block, pow2)
        return
    n_rows, n_cols = src.shape
    for r0 in range(0, n_rows, ROWS_PER_STRIPE):
        r1 = min(r0 + ROWS_PER_STRIPE, n_rows)
        y = src[r0:r1].to(torch.float32, copy=True)  # (R, K) fp32 temporary
        if block:
            s = _pow2_(_block_stripe_scale(y), pow2)  # (1, ceil(K/128))
            scale[r0 // BLOCK].copy_(s[0])
            s = s.repeat_interleave(BLOCK, dim=1)[:, :n_cols]  # (1, K)
            y.div_(s).clamp_(-FP8_MAX, FP8_MAX)
        else:
            _scale_rows_(y, scale[r0:r1], pow2)
        weight[r0:r1].copy_(y)  # fp32 -> e4m3fn, round to nearest even


def _quantize_native(src: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: bool) -> bool:
    """The fused CPU kernel, if it applies (CPU, fp32/bf16 source, unit column stride)."""
    lib = native.library_for(src, weight, scale) if scale.is_contiguous() else None
    if lib is None:
        return False
    n_rows, n_cols = src.shape
    head = (src.data_ptr(), int(src.dtype == torch.bfloat16), src.stride(0),
            weight.data_ptr(), weight.stride(0), scale.data_ptr())
    if block:
        native.run_split(lib.hrl_quantize_block, math.ceil(n_rows / BLOCK), BLOCK * n_cols,
                         lambda fn, a, b: fn(*head, a, b, n_rows, n_cols))
    else:
        native.run_split(lib.hrl_quantize_channel, n_rows, n_cols, lambda fn, a, b: fn(*head, a, b, n_cols))
    return True


def _dequantize_native(weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, block: bool) -> bool:
    """The fused CPU kernel, if it applies (CPU, e4m3fn, fp32/bf16 output, unit column stride)."""
    lib = native.library_for(out, weight, scale) if weight.dtype == FP8_DTYPE and scale.is_contiguous() else None
    if lib is None:
        return False
    n_rows, n_cols = weight.shape
    head = (weight.data_ptr(), weight.stride(0), scale.data_ptr(), int(block), scale.shape[1],
            out.data_ptr(), int(out.dtype == torch.bfloat16), out.stride(0))
    native.run_split(lib.hrl_dequantize, n_rows, n_cols, lambda fn, a, b: fn(*head, a, b, n_cols))
    return True


def _scale_rows_(y: torch.Tensor, scale_rows: torch.Tensor, pow2: bool) -> None:
    """Per channel, both paths: ``y (R, K)`` fp32 divided in place by its row scales (clamped to
    +-448, ready for the cast), which are written to ``scale_rows (R, 1)``."""
    s = _pow2_(y.abs().amax(dim=1, keepdim=True).clamp_(min=TINY).div_(FP8_MAX), pow2)  # (R, 1)
    scale_rows.copy_(s)
    y.div_(s).clamp_(-FP8_MAX, FP8_MAX)


def _block_stripe_scale(y: torch.Tensor) -> torch.Tensor:
    """Scales ``(1, ceil(K/128))`` for one stripe ``y (R <= 128, K)``: amax per 128 columns."""
    n_cols = y.shape[1]
    pad = (-n_cols) % BLOCK
    a = y.abs()
    if pad:
        a = torch.nn.functional.pad(a, (0, pad))  # zeros never raise an amax
    amax = a.view(a.shape[0], -1, BLOCK).amax(dim=(0, 2))  # (ceil(K/128),)
    return amax.clamp_(min=TINY).div_(FP8_MAX).unsqueeze(0)


def expand_scale(scale: torch.Tensor, n_rows: int, n_cols: int) -> torch.Tensor:
    """Broadcastable per-element scale for an ``[n_rows, n_cols]`` weight.

    Per channel: ``scale [N, 1]`` itself (a view). Block: an ``[N, K]`` expansion (allocates).
    """
    if scale.shape[1] == 1 and scale.shape[0] == n_rows:
        return scale
    s = scale.repeat_interleave(BLOCK, dim=0)[:n_rows]
    return s.repeat_interleave(BLOCK, dim=1)[:, :n_cols]


_FP8_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def fp8_to_float32(x: torch.Tensor) -> torch.Tensor:
    """``x.to(float32)`` for an fp8 tensor, via a 256-entry table on CPU.

    The table holds the float32 value of every byte pattern of ``x.dtype`` (computed by
    torch's own cast, so the result is bitwise identical, NaNs included); a byte-indexed
    gather is ~1.8x faster than the CPU cast kernel. Elsewhere this is the plain cast.
    """
    if x.device.type != "cpu":
        return x.to(torch.float32)
    key = (x.dtype, x.device)
    table = _FP8_TABLES.get(key)
    if table is None:
        table = torch.arange(256, dtype=torch.uint8).view(x.dtype).to(torch.float32)
        _FP8_TABLES[key] = table
    idx = x.contiguous().view(torch.uint8).reshape(-1).to(torch.int32)
    return torch.index_select(table, 0, idx).view(x.shape)


def dequantize_(weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """Write ``weight * scale`` (computed in float32, then cast) into ``out`` in place.

    ``weight [N, K]`` fp8 (e4m3fn, or a same-storage e4m3fnuz view with matching scale),
    ``scale`` per channel ``[N, 1]`` or block ``block_scale_shape(N, K)``, ``out [N, K]``.
    Deterministic: the same inputs always give bitwise the same ``out``.
    """
    n_rows, n_cols = weight.shape
    if out.shape != weight.shape or scale.dtype != torch.float32 or scale.dim() != 2:
        raise ValueError(f"dequantize_: out {tuple(out.shape)} must match weight {tuple(weight.shape)} "
                         f"and scale be 2-D float32, got {tuple(scale.shape)} {scale.dtype}")
    block = not (scale.shape[1] == 1 and scale.shape[0] == n_rows)
    _check_scale_shape("dequantize_", weight, scale, block)
    if _dequantize_native(weight, scale, out, block):
        return
    if weight.device.type != "cpu":
        _dequantize_vectorized(weight, scale, out, block)
        return
    for r0 in range(0, n_rows, ROWS_PER_STRIPE):
        r1 = min(r0 + ROWS_PER_STRIPE, n_rows)
        y = fp8_to_float32(weight[r0:r1])  # (R, K)
        if block:
            s = scale[r0 // BLOCK].repeat_interleave(BLOCK)[:n_cols].unsqueeze(0)  # (1, K)
        else:
            s = scale[r0:r1]  # (R, 1)
        out[r0:r1].copy_(y.mul_(s))


def _rows_per_chunk(n_cols: int) -> int:
    """Rows of one vectorized chunk: whole 128-row tiles, about DEVICE_CHUNK_ELEMENTS elements."""
    return max(1, DEVICE_CHUNK_ELEMENTS // (max(n_cols, 1) * BLOCK)) * BLOCK


def _tiles(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``y (R, K)`` -> (``y`` zero-padded to whole tiles, its ``[R/128, 128, K/128, 128]`` view).

    Zero padding never raises an amax of |y|; the padded rows/columns are dropped after.
    """
    pad_rows, pad_cols = (-y.shape[0]) % BLOCK, (-y.shape[1]) % BLOCK
    if pad_rows or pad_cols:
        y = torch.nn.functional.pad(y, (0, pad_cols, 0, pad_rows))
    rows, cols = y.shape
    return y, y.view(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)


def _pow2_(s: torch.Tensor, pow2: bool) -> torch.Tensor:
    """``s`` rounded up to powers of two in place when ``pow2`` (log2 is exact on powers of two)."""
    return s.log2_().ceil_().exp2_() if pow2 else s


def _quantize_vectorized(src: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: bool,
                         pow2: bool = False) -> None:
    """:func:`quantize_` in chunks of whole tiles, on ``src``'s device (bitwise the stripe loop)."""
    n_rows, n_cols = src.shape
    step = _rows_per_chunk(n_cols)
    for r0 in range(0, n_rows, step):
        r1 = min(r0 + step, n_rows)
        y = src[r0:r1].to(torch.float32, copy=True)  # (R, K) fp32 temporary
        if block:
            padded, tiles = _tiles(y)
            s = _pow2_(tiles.abs().amax(dim=(1, 3)).clamp_(min=TINY).div_(FP8_MAX), pow2)  # (R/128, K/128)
            scale[r0 // BLOCK:r0 // BLOCK + s.shape[0]].copy_(s)
            tiles.div_(s[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
            y = padded[:r1 - r0, :n_cols]
        else:
            _scale_rows_(y, scale[r0:r1], pow2)
        weight[r0:r1].copy_(y)  # fp32 -> e4m3fn, round to nearest even


def _dequantize_vectorized(weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, block: bool) -> None:
    """:func:`dequantize_` in chunks of whole tiles, on ``weight``'s device (bitwise the stripe loop)."""
    n_rows, n_cols = weight.shape
    step = _rows_per_chunk(n_cols)
    for r0 in range(0, n_rows, step):
        r1 = min(r0 + step, n_rows)
        y = fp8_to_float32(weight[r0:r1])  # (R, K)
        if block:
            padded, tiles = _tiles(y)
            tiles.mul_(scale[r0 // BLOCK:r0 // BLOCK + tiles.shape[0]][:, None, :, None])
            y = padded[:r1 - r0, :n_cols]
        else:
            y.mul_(scale[r0:r1])
        out[r0:r1].copy_(y)


def abs_error_bound(src: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on ``|dequant(quant(src)) - src|`` in float32 (see module doc).

    ``scale`` is the scale ``quantize_`` produced for ``src``; the result has ``src``'s shape.
    """
    s = expand_scale(scale, *src.shape)
    return src.abs().to(torch.float32).mul_(2.0**-4 + 2.0**-20).add_(s * 2.0**-10)


def reference_scale(src: torch.Tensor, *, block: bool, pow2: bool = False) -> torch.Tensor:
    """The scale ``quantize_`` would produce for ``src [N, K]`` (allocates; for checks)."""
    n_rows, n_cols = src.shape
    shape = block_scale_shape(n_rows, n_cols) if block else (n_rows, 1)
    scale = torch.empty(shape, dtype=torch.float32, device=src.device)
    weight = torch.empty(src.shape, dtype=FP8_DTYPE, device=src.device)
    quantize_(src, weight, scale, block=block, pow2=pow2)
    return scale
