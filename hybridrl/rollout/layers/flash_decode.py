"""Decode attention whose cost follows each row's live length: ``flash_attn_with_kvcache``.

Why: a captured decode graph has fixed shapes, so the SDPA path attends over all
``max_seq_len`` cache slots with a ``[B, 1, 1, T]`` mask hiding the unwritten ones — at
``max_seq_len`` 4096 and a live length of 300 that reads 13x the cache it needs, every
step. ``flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=...)`` takes the
per-row lengths as an int32 *device* tensor (computed inside the graph from the static
positions buffer), so the same captured kernel stops at each row's length: graph-safe,
no mask, cost ~ the live length (``benchmarks/cuda_paths.py``, "max_seq_len 4096 vs 512").

Used when all hold (decided once per engine, :func:`usable`): the ``flash_attn`` package
imports, CUDA (not ROCm), fp16/bf16, head_dim a multiple of 8 and <= 256 (other head
dims make flash-attn pad a copy of the whole cache every call), compute capability 8.x
or 9.0 (what flash-attn 2 builds for). Otherwise the engine keeps the SDPA/matmul path
of ``attention.py`` unchanged, bit for bit (CPU always; the package is optional).

Layout: our cache is ``[B, KVH, T, D]`` per layer; flash-attn wants ``[B, T, KVH, D]``
with a unit last stride and reads the batch/row/head strides, so a transposed *view*
serves (no copy). GQA is native (``KVH`` divides ``H``).
"""

from __future__ import annotations

import functools

import torch

USE_FLASH_DECODE = True  # switch: False forces the SDPA decode path everywhere
MAX_HEAD_DIM = 256


@functools.cache
def _kernel():
    """``flash_attn.flash_attn_with_kvcache`` or None when flash-attn is not installed."""
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:  # optional: pip install flash-attn
        return None
    return flash_attn_with_kvcache


def usable(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether decode attention on ``device`` in ``dtype`` runs through flash-attn."""
    device = torch.device(device)
    if not (USE_FLASH_DECODE and device.type == "cuda" and torch.version.hip is None
            and dtype in (torch.float16, torch.bfloat16)
            and head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM):
        return False
    if _kernel() is None:
        return False
    major, minor = torch.cuda.get_device_capability(device)
    return major == 8 or (major, minor) == (9, 0)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           cache_seqlens: torch.Tensor) -> torch.Tensor:
    """q ``[B, 1, H, D]``; k/v cache views ``[B, T, KVH, D]``; cache_seqlens int32 ``[B]``
    (row b attends slots ``[0, cache_seqlens[b])``) -> ``[B, 1, H, D]``."""
    return _kernel()(q, k_cache, v_cache, cache_seqlens=cache_seqlens, causal=False)
