"""Rollout/trainer mismatch correction.

The rollout engine samples with its own kernels (and maybe FP8 weights), so its
log-probs ``rollout_log_prob`` differ from the trainer's recomputation ``old_log_prob``
of the same policy: the PPO ratio then starts from π_old (trainer) while the data came
from π_rollout. Correct with the importance weight π_old / π_rollout per token:

- token-level truncated IS (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
  You Off-Policy RL Training", fengyao.notion.site; Espeholt et al. 2018 for truncation):
  ``compute_tis_weights`` → multiply into the per-token policy loss (``rollout_is_weights=``);
- sequence-level masking of outliers: a sequence whose geometric-mean ratio leaves
  [lower, upper] is removed from the loss (``compute_seq_mismatch_mask``).

Both are computed once per rollout batch, outside autograd. Shapes ``[B, L]``.
"""

from __future__ import annotations

import torch

from .masked import masked_mean, masked_sum

LOG_RATIO_CLAMP = 20.0  # keep exp() finite on wild outliers


def _log_ratio(old_log_prob, rollout_log_prob):
    return torch.clamp(old_log_prob.detach() - rollout_log_prob.detach(), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def compute_tis_weights(old_log_prob, rollout_log_prob, response_mask, *, tis_cap: float = 2.0):
    """Token-level truncated importance weights (detached, 0 outside the mask):

        w_t = min(exp(old_log_prob_t - rollout_log_prob_t), C)          C = ``tis_cap``

    Returns (weights [B, L], metrics {"tis_ratio_mean", "tis_capped_frac"}) — the ratio
    mean is taken before capping.
    """
    if tis_cap <= 0:
        raise ValueError(f"algo.tis_cap={tis_cap}: must be > 0 (typical 2.0), or None to disable TIS")
    ratio = torch.exp(_log_ratio(old_log_prob, rollout_log_prob))
    weights = torch.where(response_mask.bool(), torch.clamp(ratio, max=tis_cap), 0.0)
    metrics = {"tis_ratio_mean": masked_mean(ratio, response_mask),
               "tis_capped_frac": masked_mean((ratio > tis_cap).to(ratio.dtype), response_mask)}
    return weights, metrics


def compute_seq_mismatch_mask(old_log_prob, rollout_log_prob, response_mask, *, upper: float = 2.0,
                              lower: float | None = None):
    """Mask whole sequences whose geometric-mean ratio is out of bounds:

        ρ_i = exp( (1/|y_i|) Σ_t (old_log_prob_{i,t} - rollout_log_prob_{i,t}) )
        keep_i = lower ≤ ρ_i ≤ upper                 (``lower`` defaults to 1/upper)

    Returns (response_mask · keep [B, L], metrics {"mismatch_seq_ratio_mean", "mismatch_masked_frac"}).
    The fraction is over sequences that had response tokens.
    """
    lower = 1.0 / upper if lower is None else lower
    if not 0 < lower <= 1 <= upper:
        raise ValueError(f"mismatch mask bounds [{lower}, {upper}]: need 0 < lower <= 1 <= upper")
    n_tokens = response_mask.to(old_log_prob.dtype).sum(-1)
    log_ratio = _log_ratio(old_log_prob, rollout_log_prob)
    seq_log_ratio = masked_sum(log_ratio, response_mask, dim=-1) / n_tokens.clamp(min=1)
    seq_ratio = torch.exp(seq_log_ratio)  # [B]
    has_tokens = n_tokens > 0
    keep = (seq_ratio >= lower) & (seq_ratio <= upper)
    new_mask = response_mask * keep.unsqueeze(-1).to(response_mask.dtype)
    metrics = {"mismatch_seq_ratio_mean": masked_mean(seq_ratio, has_tokens),
               "mismatch_masked_frac": masked_mean((~keep).to(seq_ratio.dtype), has_tokens)}
    return new_mask, metrics
