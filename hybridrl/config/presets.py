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


PRESETS: dict[str, PresetFn] = {"grpo": _grpo, "dr_grpo": _dr_grpo, "dapo": _dapo, "gspo": _gspo}


def preset_values(name: str, max_tokens: int) -> dict[str, Any]:
    """The nested ``algo`` dict of preset ``name`` (validated by the caller)."""
    return PRESETS[name](max_tokens)
