"""Policy-gradient losses: PPO clip (+ dual clip, clip-higher), GSPO, CISPO, REINFORCE.

Uniform signature, so the loop calls any of them the same way::

    loss, metrics = get_policy_loss(name)(old_log_prob=..., log_prob=..., advantages=...,
                                          response_mask=..., clip=ClipRange(low=..., high=..., c=...),
                                          rollout_is_weights=...,
                                          aggregation=LossAggregation(mode=..., global_batch_info=...,
                                                                      loss_scale_factor=...))

``clip`` (:class:`ClipRange`) holds ε_low, ε_high and the dual-clip constant c (each loss
reads the fields it uses; REINFORCE none); ``aggregation`` (:class:`LossAggregation`) is
how the per-token loss becomes a scalar (``agg_loss``'s mode and normalizers).
Shapes: ``old_log_prob, log_prob, advantages, response_mask, rollout_is_weights [B, L]``.
Gradients flow only through ``log_prob``: ``old_log_prob``, ``advantages`` and
``rollout_is_weights`` are detached here. ``rollout_is_weights`` (see ``mismatch.py``)
multiply the per-token loss. Metrics are detached 0-dim tensors (no host sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .aggregation import LossAggregation
from .masked import masked_mean
from .registry import POLICY_LOSSES

LOG_RATIO_CLAMP = 20.0  # |log π/π_old| clamp before exp (verl), keeps the ratio finite
GSPO_LOG_RATIO_MAX = 10.0  # upper clamp of the sequence log-ratio (verl's GSPO)
# keywords of the flat signature these losses had before ClipRange / LossAggregation: passed
# now, they would land in **kwargs and be ignored silently, so they are refused
_REPLACED = {"clip_ratio_low": "clip=ClipRange(low=...)", "clip_ratio_high": "clip=ClipRange(high=...)",
             "clip_ratio_c": "clip=ClipRange(c=...)", "loss_agg_mode": "aggregation=LossAggregation(mode=...)",
             "global_batch_info": "aggregation=LossAggregation(global_batch_info=...)",
             "loss_scale_factor": "aggregation=LossAggregation(loss_scale_factor=...)"}


@dataclass(frozen=True, kw_only=True)
class ClipRange:
    """Clip settings of a ratio-based policy loss (verl's ``clip_ratio_low/high/c``).

    ``low``/``high``: ε_low, ε_high of ``clip(r, 1-ε_low, 1+ε_high)`` (``high > low`` is
    DAPO's clip-higher); ``c``: the dual-clip constant (> 1; None = off), ``vanilla`` only.
    """

    low: float = 0.2
    high: float = 0.2
    c: float | None = 3.0


def _prepare(old_log_prob, advantages, rollout_is_weights, kwargs):
    stale = sorted(set(kwargs) & set(_REPLACED))
    if stale:
        raise TypeError(f"policy loss: {', '.join(stale)} replaced by "
                        f"{', '.join(_REPLACED[k] for k in stale)}")
    weights = None if rollout_is_weights is None else rollout_is_weights.detach()
    return old_log_prob.detach(), advantages.detach(), weights


def _finish(pg_losses, response_mask, rollout_is_weights, aggregation: LossAggregation):
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return aggregation(pg_losses, response_mask)


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
                                clip: ClipRange = ClipRange(), rollout_is_weights=None,
                                aggregation: LossAggregation = LossAggregation(), **kwargs):
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347) with asymmetric clip-higher
    (DAPO, Yu et al. 2025, arXiv:2503.14476) and dual clip (Ye et al. 2020, arXiv:1912.09729).

        r_t = exp(log π_θ - log π_old)
        ℓ_t = max(-A_t·r_t, -A_t·clip(r_t, 1-ε_low, 1+ε_high))
        ℓ_t = min(ℓ_t, -A_t·c)    where A_t < 0                 (dual clip; c = clip.c > 1)

    ε_low, ε_high = ``clip.low``, ``clip.high``; ``clip.c=None`` turns dual clip off (plain
    PPO clip). Shapes ``[B, L]``; aggregated by ``aggregation``. Metrics: ``pg_clipfrac``
    (share of tokens where the ε clip is active), ``pg_clipfrac_lower`` (dual clip active),
    ``ppo_kl`` (k1 of KL(π_old‖π_θ)), ``ratio_mean/max/min``.
    """
    c = clip.c
    if c is not None and c <= 1.0:
        raise ValueError(f"algo.clip_ratio_c={c}: dual clip needs c > 1 (verl default 3.0) or None for off")
    old_log_prob, advantages, rollout_is_weights = _prepare(old_log_prob, advantages, rollout_is_weights, kwargs)
    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1 - clip.low, 1 + clip.high)
    clipped = torch.maximum(losses1, losses2)
    metrics = {"pg_clipfrac": masked_mean(torch.gt(losses2, losses1).to(ratio.dtype), response_mask)}
    if c is not None:
        losses3 = -advantages * c
        lower = (advantages < 0) & torch.gt(clipped, losses3)
        metrics["pg_clipfrac_lower"] = masked_mean(lower.to(ratio.dtype), response_mask)
        clipped = torch.where(advantages < 0, torch.minimum(clipped, losses3), clipped)
    else:
        metrics["pg_clipfrac_lower"] = ratio.new_zeros(())
    loss = _finish(clipped, response_mask, rollout_is_weights, aggregation)
    metrics = {k: v.detach() for k, v in metrics.items()}
    return loss, {**metrics, **_ratio_metrics(ratio, log_ratio, response_mask)}


@POLICY_LOSSES.register("gspo")
def compute_policy_loss_gspo(*, old_log_prob, log_prob, advantages, response_mask,
                             clip: ClipRange = ClipRange(low=3e-4, high=4e-4), rollout_is_weights=None,
                             aggregation: LossAggregation = LossAggregation(mode="seq-mean-token-mean"),
                             **kwargs):
    """GSPO, sequence-level importance ratio (Zheng et al. 2025, arXiv:2507.18071), token form.

        s_i     = (π_θ(y_i|x) / π_old(y_i|x))^(1/|y_i|) = exp(mean_t (log π_θ - log π_old))
        s_{i,t} = sg[s_i] · π_θ(y_{i,t}) / sg[π_θ(y_{i,t})]         (GSPO-token: value s_i)
        ℓ_{i,t} = max(-A_{i,t}·s_{i,t}, -A_{i,t}·clip(s_{i,t}, 1-ε_low, 1+ε_high))

    ε_low, ε_high = ``clip.low``, ``clip.high`` (``clip.c`` unused). Shapes ``[B, L]``.
    With a sequence-constant advantage and ``seq-mean-token-mean`` aggregation (the paper's
    objective; pass it as ``aggregation.mode``) the gradient equals sequence-level GSPO's:
    ∇ = -A_i·s_i·(1/|y_i|) Σ_t ∇log π_θ(y_{i,t}) on unclipped sequences. Paper's ε: 3e-4 / 4e-4.
    Metrics: ``pg_clipfrac`` (share of tokens in clipped sequences), ``ppo_kl``, ratio stats of s_i.
    """
    old_log_prob, advantages, rollout_is_weights = _prepare(old_log_prob, advantages, rollout_is_weights, kwargs)
    log_ratio = log_prob - old_log_prob
    n_tokens = response_mask.to(log_prob.dtype).sum(-1).clamp(min=1)
    seq_log_ratio = torch.where(response_mask.bool(), log_ratio, 0.0).sum(-1) / n_tokens  # [B]
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)  # value: seq ratio
    ratio = torch.exp(torch.clamp(token_log_ratio, max=GSPO_LOG_RATIO_MAX))
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1 - clip.low, 1 + clip.high)
    loss = _finish(torch.maximum(losses1, losses2), response_mask, rollout_is_weights, aggregation)
    metrics = {"pg_clipfrac": masked_mean(torch.gt(losses2, losses1).to(ratio.dtype), response_mask).detach(),
               "pg_clipfrac_lower": ratio.new_zeros(())}
    metrics.update(_ratio_metrics(ratio, log_ratio, response_mask))
    return loss, metrics


@POLICY_LOSSES.register("cispo")
def compute_policy_loss_cispo(*, old_log_prob, log_prob, advantages, response_mask,
                              clip: ClipRange = ClipRange(), rollout_is_weights=None,
                              aggregation: LossAggregation = LossAggregation(), **kwargs):
    """CISPO, clipped IS-weight policy optimization (MiniMax-M1, arXiv:2506.13585).

        r_t = exp(log π_θ - log π_old)
        ℓ_t = -sg[clip(r_t, 1-ε_low, 1+ε_high)] · A_t · log π_θ(y_t)

    ε_low, ε_high = ``clip.low``, ``clip.high`` (``clip.c`` unused). Shapes ``[B, L]``.
    Every token keeps a gradient (the clip bounds the weight, never drops the token). The
    paper bounds only the top: set ``clip.low=1.0`` for no lower bound. The loss value
    is not a surrogate of the return; only its gradient is meaningful. Metrics:
    ``pg_clipfrac`` (share of tokens whose weight was clipped), ``ppo_kl``, ratio stats.
    """
    old_log_prob, advantages, rollout_is_weights = _prepare(old_log_prob, advantages, rollout_is_weights, kwargs)
    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio).detach()
    weight = torch.clamp(ratio, 1 - clip.low, 1 + clip.high)
    loss = _finish(-advantages * weight * log_prob, response_mask, rollout_is_weights, aggregation)
    metrics = {"pg_clipfrac": masked_mean((weight != ratio).to(ratio.dtype), response_mask),
               "pg_clipfrac_lower": ratio.new_zeros(())}
    metrics.update(_ratio_metrics(ratio, log_ratio, response_mask))
    return loss, metrics


@POLICY_LOSSES.register("reinforce")
def compute_policy_loss_reinforce(*, old_log_prob, log_prob, advantages, response_mask,
                                  rollout_is_weights=None, aggregation: LossAggregation = LossAggregation(),
                                  **kwargs):
    """Plain REINFORCE (Williams 1992): ℓ_t = -A_t · log π_θ(y_t).

    No ratio, no clip (a ``clip`` passed is ignored): the gradient is on-policy only when
    π_θ = π_old (one mini-batch per rollout batch). ``old_log_prob`` is used only for the
    ratio metrics. Shapes ``[B, L]``; aggregated by ``aggregation``.
    """
    old_log_prob, advantages, rollout_is_weights = _prepare(old_log_prob, advantages, rollout_is_weights, kwargs)
    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    loss = _finish(-advantages * log_prob, response_mask, rollout_is_weights, aggregation)
    zero = log_prob.new_zeros(())
    metrics = {"pg_clipfrac": zero, "pg_clipfrac_lower": zero}
    metrics.update(_ratio_metrics(torch.exp(log_ratio), log_ratio, response_mask))
    return loss, metrics
