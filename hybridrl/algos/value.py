"""PPO critic loss with value clipping, and the entropy bonus."""

from __future__ import annotations

import torch

from .aggregation import agg_loss
from .masked import masked_mean


def compute_value_loss(vpreds, returns, values, response_mask, cliprange_value: float | None = 0.2,
                       loss_agg_mode: str = "token-mean", *, global_batch_info=None, loss_scale_factor=None):
    """Clipped value loss (PPO, arXiv:1707.06347; as in OpenAI baselines / verl):

        V_clip = clip(V_θ, V_old - ε_v, V_old + ε_v)
        ℓ_t    = ½ · max((V_θ - R_t)², (V_clip - R_t)²)

    ``cliprange_value=None`` → ℓ_t = ½ (V_θ - R_t)². Shapes: vpreds (new, with grad),
    returns (targets), values (old), response_mask [B, L]. Gradient only into ``vpreds``.
    Returns (loss, {"vf_clipfrac", "vpred_mean"}).
    """
    returns, values = returns.detach(), values.detach()
    losses1 = (vpreds - returns).square()
    if cliprange_value is None:
        losses, clipfrac = losses1, vpreds.new_zeros(())
    else:
        vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
        losses2 = (vpred_clipped - returns).square()
        losses = torch.maximum(losses1, losses2)
        clipfrac = masked_mean(torch.gt(losses2, losses1).to(vpreds.dtype), response_mask)
    loss = 0.5 * agg_loss(losses, response_mask, loss_agg_mode, global_batch_info=global_batch_info,
                          loss_scale_factor=loss_scale_factor)
    return loss, {"vf_clipfrac": clipfrac.detach(), "vpred_mean": masked_mean(vpreds.detach(), response_mask)}
