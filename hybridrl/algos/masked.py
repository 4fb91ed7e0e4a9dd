"""Masked reductions over per-token tensors, and group ids from ``index``.

All helpers read ``values`` only where ``mask`` is 1 (via ``torch.where``, so even a NaN
at a masked position cannot leak into a result). ``mask`` is 0/1 (float or bool).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

WHITEN_EPS = 1e-8  # added to the variance before rsqrt (verl's masked_whiten)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ values·mask over ``dim`` (all dims when None)."""
    kept = torch.where(mask.bool(), values, 0.0)
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ values·mask / Σ mask over ``dim``; 0 where the mask is empty."""
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries (all dims); unbiased (÷(n-1)) by default, 0 when n ≤ 1."""
    n = mask.to(values.dtype).sum()
    centered = values - masked_mean(values, mask)
    sq = masked_sum(centered * centered, mask)
    return sq / (n - 1).clamp(min=1) if unbiased else sq / n.clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the masked entries (unbiased var, as verl); 0 outside the mask.

    With ``shift_mean=False`` the mean is added back (scale only). Shapes: any, ``mask`` like ``values``.
    Under data parallelism the mean and variance are the global batch's (``data_parallel.py``).
    """
    from .data_parallel import dp_active, dp_masked_mean, dp_masked_var

    if dp_active():
        mean, var = dp_masked_mean(values, mask), dp_masked_var(values, mask)
    else:
        mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, 0.0)


def group_ids(index: Sequence | torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """Dense group ids ``[B]`` (long, 0..G-1) from ``index``: hashables per row or a LongTensor ``[B]``."""
    if isinstance(index, torch.Tensor):
        return torch.unique(index.reshape(-1), return_inverse=True)[1].to(device)
    ids: dict = {}
    return torch.tensor([ids.setdefault(key, len(ids)) for key in index], dtype=torch.long, device=device)


def group_mean_std(scores: torch.Tensor, gid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row group statistics of ``scores [B]``: (mean [B], unbiased std [B], group size [B]).

    Unbiased std (÷(n-1)) is ``torch.std``'s default, as verl's GRPO uses; for a group of
    one sample it is returned as 0 (the callers decide what a singleton group gets).
    """
    num_groups = int(gid.max()) + 1 if gid.numel() else 0
    zeros = scores.new_zeros(num_groups)
    size = zeros.index_add(0, gid, torch.ones_like(scores))
    mean = zeros.index_add(0, gid, scores) / size
    sq = zeros.index_add(0, gid, (scores - mean[gid]) ** 2)
    std = torch.sqrt(sq / (size - 1).clamp(min=1))
    return mean[gid], std[gid], size[gid]
