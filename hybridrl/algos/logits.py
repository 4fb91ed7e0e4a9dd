"""Per-token log-probabilities and entropy from logits, and the entropy bonus.

Memory: ``logprobs_from_logits`` never materializes a second ``[B, S, V]`` tensor beyond
``logsumexp``'s workspace (gather the chosen logit, subtract logsumexp), unlike
``log_softmax(logits).gather(...)`` which allocates a full ``[B, S, V]`` copy.
"""

from __future__ import annotations

import torch

from .aggregation import agg_loss


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[labels]: ``logits [..., V]``, ``labels [...]`` (long) → ``[...]`` float32.

    Alignment is the caller's: pass logits already shifted so ``logits[b, t]`` predicts
    ``labels[b, t]``. Computed in float32 whatever the logits dtype.
    """
    logits = logits.float()
    chosen = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return chosen - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) - Σ_v softmax(z)_v z_v: ``logits [..., V]`` → ``[...]`` float32."""
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def entropy_bonus(entropy: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", *,
                  global_batch_info=None, loss_scale_factor=None) -> torch.Tensor:
    """Aggregated entropy ``agg_loss(H, mask, mode)``; the loop subtracts ``algo.entropy_coeff`` × it
    from the policy loss (maximizing entropy, Williams & Peng 1991; Mnih et al. 2016). Shapes [B, L]."""
    return agg_loss(entropy, response_mask, loss_agg_mode, global_batch_info=global_batch_info,
                    loss_scale_factor=loss_scale_factor)
