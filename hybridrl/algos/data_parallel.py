"""Batch statistics over all data-parallel ranks.

The same convention as ``GlobalBatchInfo``: when ``torch.distributed`` is initialized,
a statistic of "the batch" is a statistic of the *global* batch (every rank's rows), so
N ranks compute what one process would. Without a process group these are the local
values and cost nothing. Every rank must call them in the same order (collectives).
"""

from __future__ import annotations

import torch


def dp_active() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1


def dp_sum(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over ranks (a new tensor; ``t`` itself is not modified)."""
    if not dp_active():
        return t
    out = t.detach().clone()
    torch.distributed.all_reduce(out)
    return out


def dp_masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of the masked entries of the global batch (0-dim)."""
    m = mask.to(values.dtype)
    stats = dp_sum(torch.stack([(values * m).sum(), m.sum()]))
    return stats[0] / stats[1].clamp(min=1)


def dp_masked_var(values: torch.Tensor, mask: torch.Tensor, *, unbiased: bool = True) -> torch.Tensor:
    """Two-pass variance of the masked entries of the global batch (0-dim)."""
    m = mask.to(values.dtype)
    mean = dp_masked_mean(values, mask)
    centered = values - mean
    stats = dp_sum(torch.stack([(centered * centered * m).sum(), m.sum()]))
    n = stats[1]
    return stats[0] / (n - 1).clamp(min=1) if unbiased else stats[0] / n.clamp(min=1)
