"""Padding removal: unpad / pad, ``cu_seqlens``, per-sequence ``position_ids``, and
token-budget micro-batches.

A padded batch ``[B, S]`` with mask ``m`` becomes one packed row of ``T = m.sum()``
tokens. Variable-length kernels (flash-attn varlen, ``npu_fusion_attention`` TND) take
the packed tokens plus ``cu_seqlens`` (``[B + 1]`` int32 cumulative lengths) and never
see an S×S mask; rotary embeddings take ``position_ids`` that restart at 0 per sequence.
Works for left, right or both-sided padding: tokens keep their order within a row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Unpadded:
    """Where the real tokens of a padded ``[B, S]`` batch live once packed.

    Attributes:
        indices: ``[T]`` long, flat positions (``b * S + s``) of the real tokens.
        cu_seqlens: ``[B + 1]`` int32, cumulative sequence lengths, ``cu_seqlens[0] = 0``.
        max_seqlen: longest sequence (python int; kernels want a host value).
        position_ids: ``[T]`` long, 0..len-1 within each sequence.
        batch_size, seq_len: the padded shape, for :func:`pad`.
    """

    indices: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    position_ids: torch.Tensor
    batch_size: int
    seq_len: int


def unpad_indices(attention_mask: torch.Tensor) -> Unpadded:
    """Packing metadata for ``attention_mask`` ``[B, S]`` (1 = token, 0 = pad)."""
    if attention_mask.dim() != 2:
        raise ValueError(f"unpad_indices: attention_mask must be [B, S], got shape {tuple(attention_mask.shape)}.")
    valid = attention_mask != 0  # (B, S)
    batch, seq = valid.shape
    lengths = valid.sum(dim=1)  # (B,)
    indices = valid.flatten().nonzero().squeeze(1)  # (T,)
    cu_seqlens = torch.zeros(batch + 1, dtype=torch.int32, device=valid.device)
    torch.cumsum(lengths, dim=0, out=cu_seqlens[1:])
    # Position within its sequence: running count of real tokens in the row, minus one.
    position_ids = (valid.cumsum(dim=1) - 1).flatten()[indices]  # (T,)
    max_seqlen = int(lengths.max()) if batch > 0 else 0
    return Unpadded(indices, cu_seqlens, max_seqlen, position_ids, batch, seq)


def unpad(x: torch.Tensor, unpadded: Unpadded) -> torch.Tensor:
    """``[B, S, *rest]`` -> ``[T, *rest]``, real tokens only."""
    return x.flatten(0, 1)[unpadded.indices]  # (B*S, *rest) -> (T, *rest)


def pad(x: torch.Tensor, unpadded: Unpadded, value: float = 0.0) -> torch.Tensor:
    """``[T, *rest]`` -> ``[B, S, *rest]`` with ``value`` at pad positions (autograd-safe)."""
    flat_shape = (unpadded.batch_size * unpadded.seq_len, *x.shape[1:])
    out = x.new_full(flat_shape, value).index_put((unpadded.indices,), x)  # (B*S, *rest)
    return out.view(unpadded.batch_size, unpadded.seq_len, *x.shape[1:])


def make_microbatches(lengths: list[int] | torch.Tensor, max_tokens_per_microbatch: int) -> list[list[int]]:
    """Split rows into micro-batches under a token budget, similar lengths together.

    Rows are sorted by length (longest first) and filled greedily; a micro-batch's cost
    is ``len(rows) * max(length)`` — what a padded forward of it computes — so the same
    groups serve the padded and packed paths. A row longer than the budget gets its own
    micro-batch.

    Args:
        lengths: per-row token counts.
        max_tokens_per_microbatch: budget in (padded) tokens.
    Returns:
        Lists of row indices into ``lengths``; each row appears exactly once.
    """
    if max_tokens_per_microbatch <= 0:
        raise ValueError(
            f"make_microbatches: max_tokens_per_microbatch must be > 0, got {max_tokens_per_microbatch}; "
            "set it to at least the longest sequence length."
        )
    lengths = [int(n) for n in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for row in order:
        # Sorted longest first, so the first row of a micro-batch sets its padded width.
        width = lengths[current[0]] if current else lengths[row]
        if current and (len(current) + 1) * width > max_tokens_per_microbatch:
            batches.append(current)
            current = []
        current.append(row)
    if current:
        batches.append(current)
    return batches


def padding_fraction(lengths: list[int] | torch.Tensor, microbatches: list[list[int]]) -> float:
    """Fraction of computed tokens that are padding if each micro-batch is padded to its
    longest row (for metrics; 0.0 for packed forwards by construction)."""
    lengths = [int(n) for n in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    real = sum(lengths[i] for mb in microbatches for i in mb)
    computed = sum(len(mb) * max(lengths[i] for i in mb) for mb in microbatches if mb)
    return 0.0 if computed == 0 else 1.0 - real / computed
