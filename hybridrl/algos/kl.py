"""KL estimators between the policy and the reference, as a loss term or a reward penalty.

Estimators of KL(π_θ ‖ π_ref) from samples y ~ π_θ, per token, with
``log_ratio = log π_θ(y) - log π_ref(y)`` (Schulman 2020, "Approximating KL Divergence",
http://joschu.net/blog/kl-approx.html):

- ``k1`` (alias ``kl``):        log_ratio                              unbiased, high variance, can be < 0
- ``k2`` (alias ``mse``):       ½·log_ratio²                           biased, low variance, ≥ 0
- ``k3`` (alias ``low_var_kl``): exp(-log_ratio) + log_ratio - 1        unbiased, low variance, ≥ 0;
  as verl: the inner log-ratio clamped to [-20, 20] and the result to [-10, 10]
- ``abs``:                      |log_ratio|

Shapes: ``log_prob, ref_log_prob [B, L]`` → ``[B, L]`` (elementwise; mask it yourself or
use ``compute_kl_loss`` / ``apply_kl_penalty``).
"""

from __future__ import annotations

import torch

from .aggregation import agg_loss
from .masked import masked_mean
from .data_parallel import dp_sum
from .registry import check_choice

K3_LOG_RATIO_CLAMP = 20.0
K3_RESULT_CLAMP = 10.0
KL_ESTIMATORS = ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs")


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL estimate ``[B, L]`` of kind ``k1|kl|k2|mse|k3|low_var_kl|abs`` (see module doc)."""
    check_choice(kind, KL_ESTIMATORS, "algo.kl.estimator", "KL estimator")
    log_ratio = log_prob - ref_log_prob
    if kind in ("k1", "kl"):
        return log_ratio
    if kind in ("k2", "mse"):
        return 0.5 * log_ratio.square()
    if kind == "abs":
        return log_ratio.abs()
    neg = torch.clamp(-log_ratio, -K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)  # log π_ref/π_θ
    return torch.clamp(torch.exp(neg) - neg - 1, -K3_RESULT_CLAMP, K3_RESULT_CLAMP)


def compute_kl_loss(*, log_prob, ref_log_prob, response_mask, kind: str = "k3", loss_agg_mode: str = "token-mean",
                    global_batch_info=None, loss_scale_factor=None, **kwargs):
    """KL as a loss term (GRPO, arXiv:2402.03300 uses k3): ``agg_loss(kl_penalty(...), mask, mode)``.

    The loop adds ``kl_coef * loss``. Gradient flows into ``log_prob`` only (ref detached).
    Returns (loss, {"kl_loss": detached loss}).
    """
    kl = kl_penalty(log_prob, ref_log_prob.detach(), kind)
    loss = agg_loss(kl, response_mask, loss_agg_mode, global_batch_info=global_batch_info,
                    loss_scale_factor=loss_scale_factor)
    return loss, {"kl_loss": loss.detach()}


class FixedKLController:
    """Constant KL coefficient β = ``kl_coef``."""

    def __init__(self, *, kl_coef: float):
        self.value = float(kl_coef)

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Adaptive β (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences", arXiv:1909.08593):

        e   = clip(KL_current / KL_target - 1, -0.2, 0.2)
        β  ← β · (1 + e · n_steps / horizon)
    """

    def __init__(self, *, kl_coef: float, target_kl: float, horizon: int = 10000):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"AdaptiveKLController(target_kl={target_kl}, horizon={horizon}): both must be > 0")
        self.value, self.target, self.horizon = float(kl_coef), float(target_kl), horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def apply_kl_penalty(*, token_level_rewards, old_log_prob, ref_log_prob, response_mask, kl_ctrl,
                     kind: str = "k1", **kwargs):
    """KL as a reward penalty (Ziegler et al. 2019; InstructGPT; verl's ``use_kl_in_reward``):

        r'_t = r_t - β · KL_t(old_log_prob, ref_log_prob)        on response tokens

    then updates ``kl_ctrl`` with the batch's mean per-sequence KL (as verl). Shapes [B, L].
    Returns (token_level_rewards [B, L], metrics {"kl_penalty", "kl_coef"}).
    """
    beta = kl_ctrl.value
    kl = torch.where(response_mask.bool(), kl_penalty(old_log_prob.detach(), ref_log_prob.detach(), kind), 0.0)
    rewards = token_level_rewards - beta * kl
    per_seq = masked_mean(kl, response_mask, dim=-1)
    # the global batch's mean under data parallelism (equal to the local mean in one process)
    current_kl = dp_sum(torch.stack([per_seq.sum(), per_seq.new_tensor(per_seq.numel())]))
    current_kl = current_kl[0] / current_kl[1]
    kl_ctrl.update(current_kl=float(current_kl), n_steps=response_mask.shape[0])
    return rewards, {"kl_penalty": current_kl.detach(), "kl_coef": torch.tensor(beta)}
