"""Policy-gradient losses: PPO clip (+ dual clip, clip-higher), GSPO, CISPO, REINFORCE.

Uniform signature, so the loop calls any of them the same way::

    loss, metrics = get_policy_loss(name)(old_log_prob=..., log_prob=..., advantages=...,
                                          response_mask=..., loss_agg_mode=..., clip_ratio_low=...,
                                          clip_ratio_high=..., clip_ratio_c=..., rollout_is_weights=...,
                                          global_batch_info=..., loss_scale_factor=...)

Shapes: ``old_log_prob, log_prob, advantages, response_mask, rollout_is_weights [B, L]``.
Gradients flow only through ``log_prob``: ``old_log_prob``, ``advantages`` and
``rollout_is_weights`` are detached here. ``rollout_is_weights`` (see ``mismatch.py``)
multiply the per-token loss. Metrics are detached 0-dim tensors (no host sync).
"""

from __future__ import annotations

import torch

from .aggregation import agg_loss
from .masked import masked_mean
from .registry import POLICY_LOSSES

LOG_RATIO_CLAMP = 20.0  # |log π/π_old| clamp before exp (verl), keeps the ratio finite
GSPO_LOG_RATIO_MAX = 10.0  # upper clamp of the sequence log-ratio (verl's GSPO)


def _prepare(old_log_prob, advantages, rollout_is_weights):
    weights = None if rollout_is_weights is None else rollout_is_weights.detach()
    return old_log_prob.detach(), advantages.detach(), weights


def _finish(pg_losses, response_mask, rollout_is_weights, agg_kwargs):
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return agg_loss(pg_losses, response_mask, **agg_kwargs)


def _ratio_metrics(ratio, log_ratio, response_mask) -> dict[str, torch.Tensor]:
    ratio, mask = ratio.detach(), response_mask.bool()
    return {
        "ppo_kl": masked_mean(-log_ratio.detach(), response_mask),  # k1 estimate of KL(π_old ‖ π_θ)
        "ratio_mean": masked_mean(ratio, response_mask),
        # no host sync: an empty mask reports 0
        "ratio_max": torch.where(mask.any(), torch.where(mask, ratio, -torch.inf).max(), 0.0),
        "ratio_min": torch.where(mask.any(), torch.where(mask, ratio, torch.inf).min(), 0.0),
    }


@POLICY_LOSSES.register("vanilla")
def compute_policy_loss_vanilla(*, old_log_prob, log_prob, advantages, response_mask,
                                loss_agg_mode: str = "token-mean", clip_ratio_low: float = 0.2,
                                clip_ratio_high: float = 0.2, clip_ratio_c: float | None = 3.0,
                                rollout_is_weights=None, global_batch_info=None, loss_scale_factor=None, **kwargs):
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347) with asymmetric clip-higher
    (DAPO, Yu et al. 2025, arXiv:2503.14476) and dual clip (Ye et al. 2020, arXiv:1912.09729).

        r_t = exp(log π_θ - log π_old)
        ℓ_t = max(-A_t·r_t, -A_t·clip(r_t, 1-ε_low, 1+ε_high))
        ℓ_t = min(ℓ_t, -A_t·c)    where A_t < 0                 (dual clip; c = clip_ratio_c > 1)

    ``clip_ratio_c=None`` turns dual clip off (plain PPO clip). Metrics: ``pg_clipfrac``
    (share of tokens where the ε clip is active), ``pg_clipfrac_lower`` (dual clip active),
    ``ppo_kl`` (k1 of KL(π_old‖π_θ)), ``ratio_mean/max/min``.
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"algo.clip_ratio_c={clip_ratio_c}: dual clip needs c > 1 (verl default 3.0) or None for off")
    old_log_prob, advantages, rollout_is_weights = _prepare(old_log_prob, advantages, rollout_is_weights)
    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped = torch.maximum(losses1, losses2)
    metrics = {"pg_clipfrac": masked_mean(torch.gt(losses2, losses1).to(ratio.dtype), response_mask)}
    if clip_ratio_c is not None:
        losses3 = -advantages * clip_ratio_c
        lower = (advantages < 0) & torch.gt(clipped, losses3)
        metrics["pg_clipfrac_lower"] = masked_mean(lower.to(ratio.dtype), response_mask)
        clipped = torch.where(advantages < 0, torch.minimum(clipped, losses3), clipped)
    else:
        metrics["pg_clipfrac_lower"] = ratio.new_zeros(())
    agg = dict(loss_agg_mode=loss_agg_mode, global_batch_info=global_batch_info, loss_scale_factor=loss_scale_factor)
    loss = _finish(clipped, response_mask, rollout_is_weights, agg)
    metrics = {k: v.detach() for k, v in metrics.items()}
    return loss, {**metrics, **_ratio_metrics(ratio, log_ratio, response_mask)}


@POLICY_LOSSES.register("gspo")
def compute_policy_loss_gspo(*, old_log_prob, log_prob, advantages, response_mask,
                             loss_agg_mode: str = "seq-mean-token-mean", clip_ratio_low: float = 3e-4,
                             clip_ratio_high: float = 4e-4, rollout_is_weights=None, global_batch_info=None,
                             loss_scale_factor=None, **kwargs):
    """GSPO, sequence-level importance ratio (Zheng et al. 2025, arXiv:2507.18071), token form.

        s_i     = (π_θ(y_i|x) / π_old(y_i|x))^(1/|y_i|) = exp(mean_t (log π_θ - log π_old))
        s_{i,t} = sg[s_i] · π_θ(y_{i,t}) / sg[π_θ(y_{i,t})]         (GSPO-token: value s_i)
        ℓ_{i,t} = max(-A_{i,t}·s_{i,t}, -A_{i,t}·clip(s_{i,t}, 1-ε_low, 1+ε_high))

    With a sequence-constant advantage and ``seq-mean-token-mean`` aggregation (the paper's
    objective; pass it as ``loss_agg_mode``) the gradient equals sequence-level GSPO's:
    ∇ = -A_i·s_i·(1/|y_i|) Σ_t ∇log π_θ(y_{i,t}) on unclipped sequences. Paper's ε: 3e-4 / 4e-4.
    Metrics: ``pg_clipfrac`` (share of tokens in clipped sequences), ``ppo_kl``, ratio stats of s_i.
    """
    old_log_prob, advantages, rollout_is_weights = _prepare(old_log_prob, advantages, rollout_is_weights)
    log_ratio = log_prob - old_log_prob
    n_tokens = response_mask.to(log_prob.dtype).sum(-1).clamp(min=1)
    seq_log_ratio = torch.where(response_mask.bool(), log_ratio, 0.0).sum(-1) / n_tokens  # [B]
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)  # value: seq ratio
    ratio = torch.exp(torch.clamp(token_log_ratio, max=GSPO_LOG_RATIO_MAX))
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    agg = dict(loss_agg_mode=loss_agg_mode, global_batch_info=global_batch_info, loss_scale_factor=loss_scale_factor)
    loss = _finish(torch.maximum(losses1, losses2), response_mask, rollout_is_weights, agg)
    metrics = {"pg_clipfrac": masked_mean(torch.gt(losses2, losses1).to(ratio.dtype), response_mask).detach(),
               "pg_clipfrac_lower": ratio.new_zeros(())}
    metrics.update(_ratio_metrics(ratio, log_ratio, response_mask))
    return loss, metrics


@POLICY_LOSSES.register("cispo")
def compute_policy_loss_cispo(*, old_log_prob, log_prob, advantages, response_mask,
                              loss_agg_mode: str = "token-mean", clip_ratio_low: float = 0.2,
                              clip_ratio_high: float = 0.2, rollout_is_weights=None, global_batch_info=None,
                              loss_scale_factor=None, **kwargs):
    """CISPO, clipped IS-weight policy optimization (MiniMax-M1, arXiv:2506.13585).

        r_t = exp(log π_θ - log π_old)
        ℓ_t = -sg[clip(r_t, 1-ε_low, 1+ε_high)] · A_t · log π_θ(y_t)

    Every token keeps a gradient (the clip bounds the weight, never drops the token). The
    paper bounds only the top: set ``clip_ratio_low=1.0`` for no lower bound. The loss value
    is not a surrogate of the return; only its gradient is meaningful. Metrics:
    ``pg_clipfrac`` (share of tokens whose weight was clipped), ``ppo_kl``, ratio stats.
    """
    old_log_prob, advantages, rollout_is_weights = _prepare(old_log_prob, advantages, rollout_is_weights)
    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio).detach()
    weight = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    agg = dict(loss_agg_mode=loss_agg_mode, global_batch_info=global_batch_info, loss_scale_factor=loss_scale_factor)
    loss = _finish(-advantages * weight * log_prob, response_mask, rollout_is_weights, agg)
    metrics = {"pg_clipfrac": masked_mean((weight != ratio).to(ratio.dtype), response_mask),
               "pg_clipfrac_lower": ratio.new_zeros(())}
    metrics.update(_ratio_metrics(ratio, log_ratio, response_mask))
    return loss, metrics


@POLICY_LOSSES.register("reinforce")
def compute_policy_loss_reinforce(*, old_log_prob, log_prob, advantages, response_mask,
                                  loss_agg_mode: str = "token-mean", rollout_is_weights=None,
                                  global_batch_info=None, loss_scale_factor=None, **kwargs):
    """Plain REINFORCE (Williams 1992): ℓ_t = -A_t · log π_θ(y_t).

    No ratio, no clip: the gradient is on-policy only when π_θ = π_old (one mini-batch per
    rollout batch). ``old_log_prob`` is used only for the ratio metrics.
    """
    old_log_prob, advantages, rollout_is_weights = _prepare(old_log_prob, advantages, rollout_is_weights)
    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    agg = dict(loss_agg_mode=loss_agg_mode, global_batch_info=global_batch_info, loss_scale_factor=loss_scale_factor)
    loss = _finish(-advantages * log_prob, response_mask, rollout_is_weights, agg)
    zero = log_prob.new_zeros(())
    metrics = {"pg_clipfrac": zero, "pg_clipfrac_lower": zero}
    metrics.update(_ratio_metrics(torch.exp(log_ratio), log_ratio, response_mask))
    return loss, metrics
