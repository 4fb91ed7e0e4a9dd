"""Attention masks in each kernel's format, built at the memory floor.

Every builder here takes a ``[B, S]`` padding mask (1 = token, 0 = pad; left, right or
both sides padded) and returns a causal mask. The naive recipe
``~((ones(S, S).tril().bool()) & (pad[:, :, None] & pad[:, None, :]))`` allocates a
float32 S×S, then a bool S×S per step: several times its output, which at long S *is*
the OOM (see background/ on the Ascend report). Here each builder

1. preallocates its output ``[B, 1, S, S]``,
2. writes the causal comparison of two O(S) index vectors straight into it
   (``torch.gt(..., out=out)`` over broadcast views: no temporaries),
3. folds in key and query padding with in-place ops against ``[B, 1, 1, S]`` /
   ``[B, 1, S, 1]`` views (O(B·S) temporaries),
4. un-masks the diagonal in place (a strided view).

So peak extra memory is the output plus O(B·S).

**Fully padded query rows.** A pad query would have every key masked, and a softmax
over an all-masked row is NaN (SDPA) or uniform garbage. Convention: *every query
attends to itself*. Real queries do anyway (causal, own position is a real token);
a pad query attends to itself only. Its output is finite and meaningless; callers
ignore outputs at pad positions.

Prefer no S×S mask at all where possible: ``is_causal=True`` for right-padded rows,
:func:`decode_mask` for decoding, and packed sequences (``hybridrl.attention.packing``)
for training.
"""

from __future__ import annotations

import torch

# torch_npu.npu_fusion_attention's compressed causal mask is always 2048 x 2048.
NPU_COMPRESSED_MASK_SIZE = 2048
# Scratch bound for builders that cannot write their output dtype directly.
_BLOCK_BYTES = 1 << 20


def _check_padding_mask(padding_mask: torch.Tensor, where: str) -> torch.Tensor:
    if padding_mask.dim() != 2:
        raise ValueError(
            f"{where}: padding_mask must be [B, S] (1 = token, 0 = pad), got shape "
            f"{tuple(padding_mask.shape)}; pass the 2D attention_mask, not a 4D mask."
        )
    return padding_mask if padding_mask.dtype == torch.bool else padding_mask != 0


def _causal_compare_into(out: torch.Tensor, op) -> torch.Tensor:
    """Write ``op(key_idx, query_idx)`` for all (i, j) into ``out`` ``[B, 1, S, S]``."""
    batch, _, seq, _ = out.shape
    idx = torch.arange(seq, device=out.device)
    key_idx = idx.view(1, 1, 1, seq).expand(batch, 1, 1, seq)  # (B, 1, 1, S), a view
    query_idx = idx.view(1, 1, seq, 1)  # (1, 1, S, 1)
    return op(key_idx, query_idx, out=out)


def _diagonal(out: torch.Tensor) -> torch.Tensor:
    return out.diagonal(dim1=-2, dim2=-1)  # (B, 1, S), a strided view of out


def npu_fusion_attention_mask(padding_mask: torch.Tensor) -> torch.Tensor:
    """``torch_npu.npu_fusion_attention`` dense mask (``sparse_mode=0``, layout B1SS).

    Args:
        padding_mask: ``[B, S]`` 0/1 (any integer dtype or bool).
    Returns:
        ``[B, 1, S, S]`` bool, **True = masked out** (future keys, pad keys; pad query
        rows are masked except their own position).
    """
    valid = _check_padding_mask(padding_mask, "npu_fusion_attention_mask")
    batch, seq = valid.shape
    out = torch.empty(batch, 1, seq, seq, dtype=torch.bool, device=valid.device)
    _causal_compare_into(out, torch.gt)  # key j > query i: future, masked
    out |= ~valid.view(batch, 1, 1, seq)  # pad keys
    out |= ~valid.view(batch, 1, seq, 1)  # pad queries
    _diagonal(out).fill_(False)  # every query sees itself: no all-masked row
    return out


def npu_compressed_causal_mask(device: torch.device | str | None = None) -> torch.Tensor:
    """The fixed 2048×2048 causal mask for ``npu_fusion_attention``'s sparse causal modes.

    Memory does not grow with S. Use it with packed (padding-free) inputs::

        torch_npu.npu_fusion_attention(
            q, k, v, num_heads, input_layout="TND",          # q: (T, H, D) packed
            atten_mask=npu_compressed_causal_mask(q.device),
            sparse_mode=3,                                   # rightDownCausal
            actual_seq_qlen=cu_seqlens[1:].tolist(),          # cumulative ends
            actual_seq_kvlen=cu_seqlens[1:].tolist(),
            scale=1 / head_dim**0.5)[0]

    (``sparse_mode=2``, leftUpCausal, takes the same mask.) Padding is then expressed by
    the sequence lengths, not by the mask. Returns ``[2048, 2048]`` bool, True = masked
    (strictly upper triangle).
    """
    size = NPU_COMPRESSED_MASK_SIZE
    out = torch.empty(size, size, dtype=torch.bool, device=device)
    idx = torch.arange(size, device=device)
    return torch.gt(idx.view(1, size), idx.view(size, 1), out=out)


def sdpa_mask(padding_mask: torch.Tensor) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` bool mask.

    Args:
        padding_mask: ``[B, S]`` 0/1.
    Returns:
        ``[B, 1, S, S]`` bool, **True = attend** (past-or-self real keys; a pad query
        attends to itself only, so SDPA never sees an all-False row and never NaNs).
    """
    valid = _check_padding_mask(padding_mask, "sdpa_mask")
    batch, seq = valid.shape
    out = torch.empty(batch, 1, seq, seq, dtype=torch.bool, device=valid.device)
    _causal_compare_into(out, torch.le)  # key j <= query i
    out &= valid.view(batch, 1, 1, seq)
    out &= valid.view(batch, 1, seq, 1)
    _diagonal(out).fill_(True)
    return out


def additive_mask(padding_mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive mask for eager attention (``scores + mask`` before softmax).

    Args:
        padding_mask: ``[B, S]`` 0/1.
        dtype: floating dtype of the scores (the mask is built directly in it).
    Returns:
        ``[B, 1, S, S]`` ``dtype``: 0 where attended, ``finfo(dtype).min`` where masked.
    """
    if not dtype.is_floating_point:
        raise ValueError(f"additive_mask: dtype must be floating point, got {dtype}; pass e.g. torch.bfloat16.")
    valid = _check_padding_mask(padding_mask, "additive_mask")
    batch, seq = valid.shape
    minimum = torch.finfo(dtype).min
    out = torch.empty(batch, 1, seq, seq, dtype=dtype, device=valid.device)
    # A comparison with a float ``out=`` computes into a hidden S×S temporary (measured:
    # 2x the output), so compare into a small bool block and cast-copy it in; the block
    # is ~_BLOCK_BYTES whatever S is.
    idx = torch.arange(seq, device=valid.device)
    rows = max(1, _BLOCK_BYTES // seq)
    block = torch.empty(rows, seq, dtype=torch.bool, device=valid.device)
    for r0 in range(0, seq, rows):
        r1 = min(seq, r0 + rows)
        future = torch.gt(idx.view(1, seq), idx[r0:r1].view(-1, 1), out=block[: r1 - r0])  # (r, S)
        out[:, 0, r0:r1].copy_(future)  # broadcast over B, cast in the copy: 1.0 = future
    out.mul_(minimum)  # 1 -> min, 0 -> 0 (or -0.0, same when added)
    out.masked_fill_(~valid.view(batch, 1, 1, seq), minimum)
    out.masked_fill_(~valid.view(batch, 1, seq, 1), minimum)
    _diagonal(out).fill_(0.0)
    return out


def decode_mask(
    cache_lengths: torch.Tensor,
    total_len: int,
    *,
    start_positions: torch.Tensor | None = None,
    kind: str = "sdpa",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Mask for one decode step against a KV cache of ``total_len`` slots.

    Row b attends cache slots ``start_positions[b] <= j < cache_lengths[b]`` (the
    current token's own slot included in ``cache_lengths``). A row with no valid slot
    (e.g. an idle row of a static batch) attends slot 0 only, so it never NaNs.

    Args:
        cache_lengths: ``[B]`` integer, valid length of each row (incl. the new token).
        total_len: T, the cache's slot count.
        start_positions: optional ``[B]`` integer, first real slot per row (left padding).
        kind: ``"sdpa"`` (bool, True = attend), ``"npu"`` (bool, True = masked out) or
            ``"additive"`` (``dtype``, 0 / ``finfo(dtype).min``).
    Returns:
        ``[B, 1, 1, T]``.
    """
    if kind not in ("sdpa", "npu", "additive"):
        raise ValueError(f"decode_mask: kind must be 'sdpa', 'npu' or 'additive', got {kind!r}.")
    lengths = cache_lengths.view(-1, 1)  # (B, 1)
    slots = torch.arange(total_len, device=cache_lengths.device).view(1, -1)  # (1, T)
    attend = slots < lengths  # (B, T)
    if start_positions is not None:
        attend &= slots >= start_positions.view(-1, 1)
    attend[:, 0] |= ~attend.any(dim=1)  # idle rows attend slot 0 only
    attend = attend.view(-1, 1, 1, total_len)  # (B, 1, 1, T)
    if kind == "sdpa":
        return attend
    if kind == "npu":
        return ~attend
    return torch.zeros(attend.shape, dtype=dtype, device=attend.device).masked_fill_(~attend, torch.finfo(dtype).min)
