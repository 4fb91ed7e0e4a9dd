"""Variable-length causal attention over packed sequences: the flash-attn shim.

``flash_attn.flash_attn_varlen_func`` (CUDA, fp16/bf16) when installed and enabled;
otherwise a per-sequence ``scaled_dot_product_attention(is_causal=True)`` loop, which
also needs no mask and costs sum(len²), not T². flash-attn is imported lazily, only
when a CUDA tensor asks for it. Tests flip :data:`USE_FLASH_ATTN` (or call
:func:`set_flash_attn_enabled`) to force the fallback.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

USE_FLASH_ATTN = True  # switch: False forces the SDPA fallback everywhere


def set_flash_attn_enabled(enabled: bool) -> None:
    global USE_FLASH_ATTN
    USE_FLASH_ATTN = bool(enabled)


@functools.cache
def _flash_varlen_func():
    """``flash_attn_varlen_func`` or None when flash-attn is not installed."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:  # optional extra: pip install flash-attn
        return None
    return flash_attn_varlen_func


def flash_attn_usable(q: torch.Tensor) -> bool:
    """Whether the flash-attn varlen kernel will serve ``q``."""
    return (
        USE_FLASH_ATTN
        and q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and _flash_varlen_func() is not None
    )


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal attention within each packed sequence.

    Args:
        q: ``[T, H, D]`` packed queries.
        k: ``[T, H_kv, D]`` (grouped-query: ``H % H_kv == 0``).
        v: ``[T, H_kv, Dv]``; ``Dv`` may differ from ``D`` (DeepSeek's MLA: 128 vs 192).
        cu_seqlens: ``[N + 1]`` int32 cumulative sequence lengths.
        max_seqlen: longest sequence.
    Returns:
        ``[T, H, Dv]`` in ``q.dtype``.
    """
    if flash_attn_usable(q):
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        d, dv = q.shape[-1], v.shape[-1]
        if dv != d:  # flash-attn 2 wants one head dim: zero-pad the narrower side, slice the output
            scale = d ** -0.5 if scale is None else scale  # the unpadded width's
            width = max(d, dv)
            q, k, v = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
        out = _flash_varlen_func()(
            q, k, v, cu, cu, max_seqlen, max_seqlen, dropout_p=dropout_p, softmax_scale=scale, causal=True
        )
        return out[..., :dv]
    # CPU / no flash-attn: one SDPA call per sequence. Inputs stay 4-D ([1, H, L, D]):
    # torch's CPU flash kernel (causal blocks skipped, GQA native) only serves 4-D
    # inputs; 3-D ones fall to the math path, which materialises L×L scores and runs
    # 2x slower forward. Sequences are cut with one ``split`` and joined with one
    # ``cat``: their backwards are one concat / one slice per piece, where per-sequence
    # slicing or slice-assignment would each cost a full-size gradient per sequence.
    lengths = cu_seqlens.diff().tolist()  # host copy once per call; fallback path
    gqa = q.shape[1] != k.shape[1]
    pieces = []
    for q_i, k_i, v_i in zip(q.split(lengths), k.split(lengths), v.split(lengths)):
        if q_i.shape[0] == 0:
            continue
        q_i, k_i, v_i = (t.transpose(0, 1).unsqueeze(0) for t in (q_i, k_i, v_i))  # (1, H, L, D)
        o_i = F.scaled_dot_product_attention(
            q_i, k_i, v_i, is_causal=True, scale=scale, dropout_p=dropout_p, enable_gqa=gqa
        )
        pieces.append(o_i[0].transpose(0, 1))  # (L, H, D)
    return torch.cat(pieces) if pieces else q.new_empty(*q.shape[:2], v.shape[-1])
