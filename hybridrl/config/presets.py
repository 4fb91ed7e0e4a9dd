"""Published recipes as presets: ``algo.preset=<name>`` fills the ``algo`` keys with the
paper's values; any key given explicitly (YAML or a dotted override) still wins.

Each preset is a function of the resolved rollout length, because DAPO's overlong buffer
is a fraction of the maximum response length. Values and sources:

- ``grpo``   — DeepSeekMath (Shao et al. 2024, arXiv:2402.03300): group-normalized
  advantages, PPO clip 0.2, per-sequence mean of token losses, KL to the reference as a
  k3 loss term with β = 0.04.
- ``dr_grpo`` — "Understanding R1-Zero-Like Training" (Liu et al. 2025, arXiv:2503.20783):
  no std normalization, token losses summed and divided by a constant (the max length),
  no KL.
- ``dapo``   — DAPO (Yu et al. 2025, arXiv:2503.14476): clip-higher (0.2 / 0.28), token-
  mean loss, no KL, dynamic sampling (refilled), soft overlong punishment over the last
  fifth of the length budget (the paper's 4096 of 20480 tokens).
- ``gspo``   — GSPO (Zheng et al. 2025, arXiv:2507.18071): sequence-level ratio, clip
  3e-4 / 4e-4, per-sequence mean of token losses, no KL.
- ``rlhf_ppo`` — classic RLHF (InstructGPT, Ouyang et al. 2022, arXiv:2203.02155, with the
  values of TRL's ``PPOConfig`` and "The N+ Implementation Details of RLHF with PPO", Huang et
  al. 2024, arXiv:2403.17031): a critic (GAE, gamma 1, lambda 0.95, value clip 0.2), PPO clip
  0.2, token-mean losses, the KL to the reference as a per-token penalty *in the reward*
  (k1, beta = 0.05). Give it a reward model: ``reward.model=PATH`` (docs/rewards.md); TRL
  also runs 4 PPO epochs per batch (``batch.ppo_epochs=4``, not an ``algo`` key).
"""

from __future__ import annotations

from typing import Any, Callable

PresetFn = Callable[[int], dict[str, Any]]


def _grpo(max_tokens: int) -> dict[str, Any]:
    return {"loss_agg_mode": "seq-mean-token-mean",
            "advantage": {"estimator": "grpo", "norm_by_std": True},
            "policy_loss": {"name": "vanilla", "clip_ratio_low": 0.2, "clip_ratio_high": 0.2},
            "kl": {"coef": 0.04, "estimator": "k3", "use_loss": True}}


def _dr_grpo(max_tokens: int) -> dict[str, Any]:
    return {"loss_agg_mode": "seq-mean-token-sum-norm",
            "advantage": {"estimator": "dr_grpo"},
            "policy_loss": {"name": "vanilla", "clip_ratio_low": 0.2, "clip_ratio_high": 0.2},
            "kl": {"coef": 0.0}}


def _dapo(max_tokens: int) -> dict[str, Any]:
    return {"loss_agg_mode": "token-mean",
            "advantage": {"estimator": "grpo", "norm_by_std": True},
            "policy_loss": {"name": "vanilla", "clip_ratio_low": 0.2, "clip_ratio_high": 0.28},
            "kl": {"coef": 0.0},
            "dapo": {"dynamic_sampling": True, "refill_rounds": 3,
                     "overlong_buffer_len": max(1, max_tokens // 5), "overlong_penalty_factor": 1.0}}


def _gspo(max_tokens: int) -> dict[str, Any]:
    return {"loss_agg_mode": "seq-mean-token-mean",
            "advantage": {"estimator": "grpo", "norm_by_std": True},
            "policy_loss": {"name": "gspo", "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4},
            "kl": {"coef": 0.0}}


def _rlhf_ppo(max_tokens: int) -> dict[str, Any]:
    return {"loss_agg_mode": "token-mean",
            "advantage": {"estimator": "gae", "gamma": 1.0, "lam": 0.95},
            "policy_loss": {"name": "vanilla", "clip_ratio_low": 0.2, "clip_ratio_high": 0.2},
            "value": {"cliprange": 0.2},
            "kl": {"coef": 0.05, "estimator": "k1", "use_loss": False}}


PRESETS: dict[str, PresetFn] = {"grpo": _grpo, "dr_grpo": _dr_grpo, "dapo": _dapo, "gspo": _gspo,
                                "rlhf_ppo": _rlhf_ppo}


def preset_values(name: str, max_tokens: int) -> dict[str, Any]:
    """The nested ``algo`` dict of preset ``name`` (validated by the caller)."""
    return PRESETS[name](max_tokens)
