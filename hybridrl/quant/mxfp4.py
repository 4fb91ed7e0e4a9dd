"""MXFP4 (OCP Microscaling, FP4 E2M1 elements) quantization into preallocated tensors, in place.

Format (OCP Microscaling Formats (MX) v1.0, sections 5.3 and 6.3). A weight ``w [..., K]``
is cut along its last (input / reduction) dimension into blocks of ``BLOCK = 32``
elements. Each block stores

- 32 FP4 **E2M1** codes, two per byte: element ``2j`` in the *low* nibble of byte ``j``,
  element ``2j+1`` in the high nibble (the order of torch's ``float4_e2m1fn_x2`` and of
  gpt-oss / vLLM MXFP4 checkpoints). A code is ``sign << 3 | exponent << 1 | mantissa``;
  its magnitudes are ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` (exponent bias 1, one subnormal 0.5,
  no inf, no NaN);
- one **E8M0** scale byte: the power of two ``2**(bits - 127)``, ``bits = 255`` is NaN.

So the tensors are ``blocks [..., K/2] uint8`` and ``scales [..., K/32] uint8``: the byte
layout of a gpt-oss ``*_blocks [..., K/32, 16]`` / ``*_scales [..., K/32]`` pair.
``blocks.view(torch.float4_e2m1fn_x2)`` and ``scales.view(torch.float8_e8m0fnu)`` are
zero-copy views for kernels that take torch's MX dtypes.

Quantization (6.3): ``X = 2**(floor(log2(amax)) - 2)`` where ``amax = max |w|`` of the block
and 2 is the largest exponent of E2M1 (6 = 1.5 * 2**2); each element becomes
``round_to_nearest_even(w / X)`` on the E2M1 grid, *saturating* to +-6 (``|w / X|`` is in
``[0, 8)``, so the top of the range clamps). Edge cases: an all-zero block gets the
smallest scale, ``bits = 0`` (``2**-127``), and zero codes; the scale exponent is clamped
to ``[-127, 127]``; a block holding inf or NaN gets the NaN scale (``bits = 255``) and
decodes to NaN everywhere (the OCP rule: the scale is NaN when the block's max is not
finite). -0 keeps its sign bit.

Exactness: ``X`` is a power of two, so ``w / X`` and ``code * X`` are exact in float32,
and the dequantized value is exact in float32 and bfloat16 (at most 2 significant bits
times a power of two inside either range). The only error is the rounding to the E2M1
grid: with ``y = w / X``, the grid spacing is 0.5 below 2, 1 below 4 and 2 up to 6, so
``|round(y) - y| <= max(|y|, 1) / 4`` (the saturated range ``6 < |y| < 8`` included:
``|y| - 6 < |y| / 4``). Hence, elementwise,

    |dequant(quant(w)) - w| <= max(|w|, X) / 4          (``abs_error_bound``)

i.e. 25% relative error for elements near their block's max, and at most ``X / 4`` for
small ones — MXFP4 is a coarse format; it buys 4.25 bits per weight.

Like ``hybridrl.quant.fp8``, every function writes into tensors the caller owns and never
rebinds them (a captured CUDA graph holds their addresses), and works in row chunks so
the float32 temporaries stay bounded (``CHUNK_ELEMENTS``), on any device.

On CPU, :func:`quantize_` and :func:`dequantize_` run the fused one-pass kernels of
``mxfp4_kernels.c`` (:mod:`hybridrl.quant.native`) when they could be built, for float32 /
bfloat16 sources and outputs: bitwise the same bytes, no temporaries at all, 55-64x faster
quantizing and ~11x dequantizing (one thread). The torch code below is the reference and
the fallback (no compiler, ``HYBRIDRL_NATIVE_KERNELS=0``, other dtypes, other devices).
"""
from __future__ import annotations

import torch

from hybridrl.quant import native

BLOCK = 32  # elements per shared scale, along the input dimension
E2M1_MAX = 6.0
E2M1_EMAX = 2  # largest E2M1 exponent: 6 = 1.5 * 2**2
E8M0_BIAS = 127
E8M0_NAN = 255
SCALE_EXP_MIN, SCALE_EXP_MAX = -127, 127
CHUNK_ELEMENTS = 1 << 22  # float32 temporaries per chunk: 16 MiB
# The E2M1 magnitudes by 3-bit code; the sign is bit 3.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_DTYPE = getattr(torch, "float4_e2m1fn_x2", None)  # torch's packed MX element dtype, where available
E8M0_DTYPE = getattr(torch, "float8_e8m0fnu", None)
# Round-to-nearest-even thresholds on |y|: code = number passed. At a tie the even code
# wins, so the comparison is strict (">") where the lower neighbour is even and ">="
# where the upper one is: 0.25 (0|0.5 -> 0), 0.75 (0.5|1 -> 1), 1.25 (1|1.5 -> 1),
# 1.75 (1.5|2 -> 2), 2.5 (2|3 -> 2), 3.5 (3|4 -> 4), 5 (4|6 -> 4).
_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
# The same as one sorted boundary list for ``torch.bucketize`` (which counts boundaries
# strictly below |y|): ``a >= t`` is ``a > nextafter(t, 0)`` for float32 ``a``.
_BOUNDARIES = [t if not inclusive else float(torch.nextafter(torch.tensor(t), torch.tensor(0.0)))
               for t, inclusive in _THRESHOLDS]


def blocks_shape(shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    """Shape of the packed-codes tensor for a weight of ``shape`` (last dim halved)."""
    _check_k(shape[-1])
    return (*shape[:-1], shape[-1] // 2)


def scales_shape(shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    """Shape of the E8M0 scales tensor for a weight of ``shape`` (one per 32 along the last dim)."""
    _check_k(shape[-1])
    return (*shape[:-1], shape[-1] // BLOCK)


def _check_k(k: int) -> None:
    if k % BLOCK:
        raise ValueError(f"MXFP4 needs the input dimension to be a multiple of {BLOCK}, got {k}")


def _rows(t: torch.Tensor, width: int, what: str) -> torch.Tensor:
    """``t`` as a ``[rows, width]`` view of the same storage (raises if it is not viewable)."""
    try:
        return t.view(-1, width)
    except RuntimeError:
        raise ValueError(f"MXFP4 {what} must be viewable as [rows, {width}] (a contiguous slice), got "
                         f"shape {tuple(t.shape)} stride {t.stride()}") from None


def _check(src_shape, blocks: torch.Tensor, scales: torch.Tensor, fn: str) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{fn}: blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}")
    if tuple(blocks.shape) != blocks_shape(src_shape) or tuple(scales.shape) != scales_shape(src_shape):
        raise ValueError(f"{fn}: blocks {tuple(blocks.shape)} / scales {tuple(scales.shape)} do not fit a "
                         f"{tuple(src_shape)} weight; expected {blocks_shape(src_shape)} / {scales_shape(src_shape)}")


def _chunk_rows(k: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(k, 1))


def pow2_float32(exponent: torch.Tensor) -> torch.Tensor:
    """``2.0 ** exponent`` (int tensor in [-126, 127]) in float32, exactly, built from its bits."""
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


def e8m0_to_float32(bits: torch.Tensor) -> torch.Tensor:
    """E8M0 scale bytes -> float32 ``2**(bits - 127)``; 0 -> ``2**-127`` (subnormal), 255 -> NaN."""
    b = bits.to(torch.int32)
    v = b << 23  # bits 1..254: a normal float32 with that biased exponent and zero mantissa
    v = torch.where(b == 0, torch.full_like(v, 0x00400000), v)  # 2**-127
    v = torch.where(b == E8M0_NAN, torch.full_like(v, 0x7FC00000), v)
    return v.view(torch.float32)


def quantize_(src: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """Quantize ``src [..., K]`` (any float dtype) into ``blocks [..., K/2]`` and ``scales [..., K/32]``
    (uint8, preallocated, written in place; each must be viewable as rows of its width)."""
    _check(src.shape, blocks, scales, "mxfp4.quantize_")
    k = src.shape[-1]
    src2 = src.reshape(-1, k)
    b2, s2 = _rows(blocks, k // 2, "blocks"), _rows(scales, k // BLOCK, "scales")
    if _quantize_native(src2, b2, s2):
        return
    step = _chunk_rows(k)
    for r0 in range(0, src2.shape[0], step):
        r1 = min(r0 + step, src2.shape[0])
        codes, bits = _quantize_rows(src2[r0:r1])
        s2[r0:r1].copy_(bits)
        b2[r0:r1].copy_(codes[:, 0::2] | (codes[:, 1::2] << 4))


def _quantize_native(src: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> bool:
    """The fused CPU kernel on ``[rows, K]`` / ``[rows, K/2]`` / ``[rows, K/32]`` views, if it
    applies (CPU, float32/bfloat16 source, unit column stride)."""
    lib = native.library_for(src, blocks, scales)
    if lib is None:
        return False
    n_rows, k = src.shape
    head = (src.data_ptr(), int(src.dtype == torch.bfloat16), src.stride(0),
            blocks.data_ptr(), blocks.stride(0), scales.data_ptr(), scales.stride(0))
    native.run_split(lib.hrl_mxfp4_quantize, n_rows, k, lambda fn, a, b: fn(*head, a, b, k))
    return True


def _dequantize_native(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> bool:
    """The fused CPU kernel on row views, if it applies (CPU, float32/bfloat16 output, unit column stride)."""
    lib = native.library_for(out, blocks, scales)
    if lib is None:
        return False
    n_rows, k = out.shape
    head = (blocks.data_ptr(), blocks.stride(0), scales.data_ptr(), scales.stride(0),
            out.data_ptr(), int(out.dtype == torch.bfloat16), out.stride(0))
    native.run_split(lib.hrl_mxfp4_dequantize, n_rows, k, lambda fn, a, b: fn(*head, a, b, k))
    return True


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, K]`` -> (codes ``[R, K]`` uint8 (unpacked), scale bits ``[R, K/32]`` uint8)."""
    r, k = x.shape
    a = x.abs().to(torch.float32).view(r, k // BLOCK, BLOCK)  # the one float32 temporary
    amax = a.amax(dim=-1)  # (R, nb); NaN propagates
    finite = torch.isfinite(amax)
    _, e = torch.frexp(amax)  # amax = m * 2**e, m in [0.5, 1): floor(log2(amax)) = e - 1
    shared = (e - 1 - E2M1_EMAX).clamp_(SCALE_EXP_MIN, SCALE_EXP_MAX)
    shared = torch.where(amax == 0, torch.full_like(shared, SCALE_EXP_MIN), shared)
    shared = torch.where(finite, shared, torch.zeros_like(shared))
    bits = (shared + E8M0_BIAS).to(torch.uint8)
    bits.masked_fill_(~finite, E8M0_NAN)
    # |x| / X exactly: multiply by 2**-shared (shared in [-127, 125] for finite blocks, so
    # -shared in [-125, 127]: a normal float32).
    a.mul_(pow2_float32(-shared).unsqueeze(-1))
    codes = torch.bucketize(a, _boundaries(a.device), out_int32=True).to(torch.uint8)
    codes |= torch.signbit(x).view(r, k // BLOCK, BLOCK).to(torch.uint8) << 3
    if x.device.type != "cpu" or not bool(finite.all()):  # (a host check is free on CPU)
        codes.masked_fill_(~finite.unsqueeze(-1), 0)  # a NaN block: its codes do not matter; zero them
    return codes.view(r, k), bits


_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def _boundaries(device: torch.device) -> torch.Tensor:
    key = ("boundaries", device)
    if key not in _TABLES:
        _TABLES[key] = torch.tensor(_BOUNDARIES, dtype=torch.float32, device=device)
    return _TABLES[key]


def _byte_table(device: torch.device) -> torch.Tensor:
    """``[256, 2]`` float32: the two E2M1 values of every packed byte (low nibble first)."""
    key = ("bytes", device)
    if key not in _TABLES:
        mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
        values = torch.cat([mags, -mags])  # code 8 is -0.0
        byte = torch.arange(256)
        _TABLES[key] = torch.stack([values[byte & 0xF], values[byte >> 4]], dim=1).to(device)
    return _TABLES[key]


def codes_to_float32(blocks: torch.Tensor) -> torch.Tensor:
    """Packed codes ``[..., K/2]`` -> float32 E2M1 values ``[..., K]`` (unscaled): one byte-indexed gather."""
    idx = blocks.reshape(-1).to(torch.int32)
    return torch.index_select(_byte_table(blocks.device), 0, idx).view(*blocks.shape[:-1], blocks.shape[-1] * 2)


def dequantize_(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """Write ``code * 2**(scale - 127)`` (float32, exact; then cast) into ``out [..., K]`` in place."""
    _check(out.shape, blocks, scales, "mxfp4.dequantize_")
    k = out.shape[-1]
    b2 = blocks.reshape(-1, k // 2)
    s2 = scales.reshape(-1, k // BLOCK)
    o2 = _rows(out, k, "out")
    if _dequantize_native(b2, s2, o2):
        return
    step = _chunk_rows(k)
    for r0 in range(0, b2.shape[0], step):
        r1 = min(r0 + step, b2.shape[0])
        vals = codes_to_float32(b2[r0:r1]).view(r1 - r0, k // BLOCK, BLOCK)
        vals.mul_(e8m0_to_float32(s2[r0:r1]).unsqueeze(-1))
        o2[r0:r1].copy_(vals.view(r1 - r0, k))


def quantize(src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place :func:`quantize_`: fresh ``(blocks, scales)`` on ``src``'s device."""
    blocks = torch.empty(blocks_shape(src.shape), dtype=torch.uint8, device=src.device)
    scales = torch.empty(scales_shape(src.shape), dtype=torch.uint8, device=src.device)
    quantize_(src, blocks, scales)
    return blocks, scales


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Out-of-place :func:`dequantize_` into a fresh ``[..., K]`` tensor of ``dtype``."""
    out = torch.empty((*blocks.shape[:-1], blocks.shape[-1] * 2), dtype=dtype, device=blocks.device)
    dequantize_(blocks, scales, out)
    return out


def abs_error_bound(src: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Elementwise bound ``max(|src|, X) / 4`` on ``|dequant(quant(src)) - src|`` (float32,
    ``src``'s shape); ``scales`` are the E8M0 bytes ``quantize_`` produced for ``src``."""
    x = e8m0_to_float32(scales).repeat_interleave(BLOCK, dim=-1)
    return torch.maximum(src.abs().to(torch.float32), x).mul_(0.25)
