"""Algorithms as pure tensor functions: advantages, policy losses, KL, loss aggregation.

Depends on torch only. See docs/algorithms.md for every option, its formula and source.
"""

from . import gae as _gae  # noqa: F401  (registers gae, reinforce_plus_plus)
from .advantages import scores_to_token_level_rewards
from .aggregation import LOSS_AGG_MODES, GlobalBatchInfo, LossAggregation, agg_loss
from .dapo import dynamic_sampling_keep, mask_truncated_responses, overlong_reward_penalty
from .kl import (KL_ESTIMATORS, AdaptiveKLController, FixedKLController, apply_kl_penalty, compute_kl_loss,
                 kl_penalty)
from .logits import entropy_bonus, entropy_from_logits, logprobs_from_logits
from .masked import masked_mean, masked_sum, masked_var, masked_whiten
from .mismatch import compute_seq_mismatch_mask, compute_tis_weights
from .policy_losses import (ClipRange, compute_policy_loss_cispo, compute_policy_loss_gspo,
                            compute_policy_loss_reinforce, compute_policy_loss_vanilla)
from .registry import ADV_ESTIMATORS, POLICY_LOSSES, get_adv_estimator, get_policy_loss
from .value import compute_value_loss

__all__ = [
    "ADV_ESTIMATORS", "POLICY_LOSSES", "LOSS_AGG_MODES", "KL_ESTIMATORS",
    "get_adv_estimator", "get_policy_loss", "agg_loss", "GlobalBatchInfo", "LossAggregation", "ClipRange",
    "kl_penalty", "compute_kl_loss", "apply_kl_penalty", "AdaptiveKLController", "FixedKLController",
    "compute_value_loss", "entropy_bonus", "entropy_from_logits", "logprobs_from_logits",
    "compute_tis_weights", "compute_seq_mismatch_mask",
    "overlong_reward_penalty", "mask_truncated_responses", "dynamic_sampling_keep",
    "scores_to_token_level_rewards", "masked_mean", "masked_sum", "masked_var", "masked_whiten",
    "compute_policy_loss_vanilla", "compute_policy_loss_gspo", "compute_policy_loss_cispo",
    "compute_policy_loss_reinforce",
]
