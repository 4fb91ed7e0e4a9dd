"""DeepSeek-V4's lightning-indexer selection: which compressed entries a query attends to.

The indexer scores every complete entry ``c`` of a query ``t`` with
``sum_h w_h * relu(q_h . k_c)`` and keeps the ``index_topk`` best. That score is *exactly*
0 whenever every head's dot product is <= 0 — with few indexer heads a large share of all
scores (a quarter with 2 heads) — so the k-th pick often falls among equal scores, and
``torch.topk`` breaks such ties by where they sit in the score row. The row's length is the
padded batch length / rate in a full forward and the state's capacity in a decode step, so
transformers' selection (and a copy of it) depends on the batch and on what follows the
token: the engine then samples from one distribution while the trainer scores another.

hybridrl's rule, the same in the engine's prefill and decode and in the trainer's forward:
**the highest scores, ties to the most recent entry** (the larger index). The order is total
on (score, index), so the chosen set depends only on the query's scores over its complete
entries — never on how many future or padding entries share the row. It is implemented as
one ``topk`` over int64 keys ``(ordered score bits) * 2^32 + index``: unique, so the kernel has
no tie to break, on any device. Where all scores are distinct it picks what transformers
picks (tested); it differs only where transformers' own answer depends on the row length.
"""
from __future__ import annotations

import torch

_LOW_BITS = 0x7FFFFFFF
_INDEX_SPAN = 1 << 32  # room for the entry index below the score bits


def ordered_score_keys(scores: torch.Tensor) -> torch.Tensor:
    """float32 ``scores [..., n]`` -> int64 keys ``[..., n]`` ordered as ``(score, index)``.

    The float32 bits read as int32 are monotone in the float order once a negative number's
    lower 31 bits are flipped (IEEE-754 sign-magnitude); ``+ 0.0`` first turns -0.0 (a zero
    score times a negative head weight) into +0.0, so equal scores get equal score bits."""
    bits = (scores.float() + 0.0).view(torch.int32)
    ordered = bits ^ ((bits >> 31) & _LOW_BITS)
    index = torch.arange(scores.shape[-1], device=scores.device, dtype=torch.int64)
    return ordered.to(torch.int64) * _INDEX_SPAN + index


def select_top_entries(scores: torch.Tensor, complete: torch.Tensor, topk: int) -> torch.Tensor:
    """The entries each query reads.

    Args:
        scores: ``[..., n]`` float32, the indexer's scores of every entry in the row.
        complete: ``[...]`` long, the number of complete entries each query may read
            (``(position + 1) // rate``); entries at or past it are never chosen.
        topk: ``index_topk``.
    Returns:
        ``[..., min(topk, n)]`` long ids, highest score first with ties to the larger
        index, ``-1`` where the query has fewer than ``topk`` complete entries.
    """
    n = scores.shape[-1]
    k = min(topk, n)
    if k == 0:
        return torch.empty(*scores.shape[:-1], 0, dtype=torch.long, device=scores.device)
    keys = ordered_score_keys(scores)
    entry = torch.arange(n, device=scores.device)
    future = entry >= complete.unsqueeze(-1)  # (..., n)
    ids = keys.masked_fill(future, torch.iinfo(torch.int64).min).topk(k, dim=-1).indices
    return torch.where(ids >= complete.unsqueeze(-1), torch.full_like(ids, -1), ids)
