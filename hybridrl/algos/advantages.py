"""Outcome-reward advantage estimators: GRPO, Dr. GRPO, RLOO, REINFORCE++-baseline, ReMax.

Each takes ``token_level_rewards [B, L]`` (the scalar score placed on the last response
token, as verl does; see ``scores_to_token_level_rewards``) and ``response_mask [B, L]``,
reduces the rewards to a per-sequence score ``s_i = Σ_t r_{i,t}·m_{i,t}``, computes a
scalar advantage per sequence and broadcasts it over the response tokens. All return
``(advantages, returns)``, both ``[B, L]``, zero outside ``response_mask``. Keyword-only,
unknown keywords ignored, so the loop calls every estimator the same way.

``index`` is the per-row group id (rows sampled from the same prompt share it):
a list/array of hashables or a LongTensor ``[B]``.
"""

from __future__ import annotations

import torch

from .masked import group_ids, group_mean_std, masked_sum, masked_whiten
from .registry import ADV_ESTIMATORS

GRPO_EPS = 1e-6  # added to the group std before dividing (verl's epsilon)


def scores_to_token_level_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each row's scalar score ``scores [B]`` on its last response token → ``[B, L]``.

    Rows without response tokens get all zeros.
    """
    L = response_mask.shape[-1]
    positions = torch.arange(L, device=response_mask.device).expand_as(response_mask)
    last = torch.where(response_mask.bool(), positions, -1).amax(-1)  # [B], -1 = empty row
    onehot = (positions == last.unsqueeze(-1)) & (last.unsqueeze(-1) >= 0)
    scores = torch.as_tensor(scores, device=response_mask.device)
    scores = scores if scores.is_floating_point() else scores.to(torch.float32)
    return torch.where(onehot, scores.unsqueeze(-1), 0.0)


def _sequence_scores(token_level_rewards, response_mask) -> torch.Tensor:
    return masked_sum(token_level_rewards, response_mask, dim=-1)  # [B]


def _broadcast(adv_per_seq: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] → [B, L]: the scalar on every response token, 0 elsewhere."""
    return torch.where(response_mask.bool(), adv_per_seq.unsqueeze(-1), 0.0)


def _require(name: str, **inputs) -> None:
    for key, value in inputs.items():
        if value is None:
            raise ValueError(f"algo.adv_estimator={name!r} needs `{key}`; pass {key}=... (see docs/algorithms.md)")


@ADV_ESTIMATORS.register("grpo", requires=("index",))
def compute_grpo_outcome_advantage(*, token_level_rewards, response_mask, index=None,
                                   norm_adv_by_std_in_grpo: bool = True, epsilon: float = GRPO_EPS, **kwargs):
    """GRPO group-relative advantage (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

        A_i = (s_i - mean_g(s)) / (std_g(s) + ε)      norm_adv_by_std_in_grpo=True
        A_i =  s_i - mean_g(s)                        norm_adv_by_std_in_grpo=False (Dr. GRPO)

    std_g is the *unbiased* group std (÷(G-1), ``torch.std``), ε = 1e-6, both as verl.
    A one-sample group (G = 1) gets mean 0 and std 1, i.e. A_i = s_i / (1 + ε) (verl's
    convention: no baseline, no scaling; s_i without std normalization).
    Shapes: token_level_rewards, response_mask [B, L]; index [B]. Returns (A, A) [B, L].
    """
    _require("grpo", index=index)
    scores = _sequence_scores(token_level_rewards, response_mask)
    mean, std, size = group_mean_std(scores, group_ids(index, scores.device))
    singleton = size == 1
    mean = torch.where(singleton, 0.0, mean)
    std = torch.where(singleton, 1.0, std)
    adv = (scores - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else scores - mean
    adv = _broadcast(adv, response_mask)
    return adv, adv


@ADV_ESTIMATORS.register("dr_grpo", requires=("index",))
def compute_dr_grpo_outcome_advantage(*, token_level_rewards, response_mask, index=None, **kwargs):
    """Dr. GRPO advantage (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783).

        A_i = s_i - mean_g(s)          (no division by the group std)

    The other half of Dr. GRPO is the loss aggregation ``seq-mean-token-sum-norm``.
    Singleton groups get A_i = s_i. Shapes as ``grpo``.
    """
    _require("dr_grpo", index=index)
    return compute_grpo_outcome_advantage(token_level_rewards=token_level_rewards, response_mask=response_mask,
                                          index=index, norm_adv_by_std_in_grpo=False)


@ADV_ESTIMATORS.register("rloo", requires=("index",))
def compute_rloo_outcome_advantage(*, token_level_rewards, response_mask, index=None, **kwargs):
    """RLOO leave-one-out baseline (Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740).

        A_i = s_i - 1/(G-1) Σ_{j≠i} s_j  =  G/(G-1) · (s_i - mean_g(s))

    A one-sample group gets A_i = s_i (as verl). Shapes as ``grpo``.
    """
    _require("rloo", index=index)
    scores = _sequence_scores(token_level_rewards, response_mask)
    mean, _, size = group_mean_std(scores, group_ids(index, scores.device))
    adv = torch.where(size > 1, (scores - mean) * size / (size - 1).clamp(min=1), scores)
    adv = _broadcast(adv, response_mask)
    return adv, adv


@ADV_ESTIMATORS.register("reinforce_plus_plus_baseline", requires=("index",))
def compute_reinforce_plus_plus_baseline_outcome_advantage(*, token_level_rewards, response_mask, index=None,
                                                           **kwargs):
    """REINFORCE++-baseline (Hu 2025, "REINFORCE++", arXiv:2501.03262).

        A_{i,t} = whiten_batch(s_i - mean_g(s))

    The group-mean baseline is subtracted per sequence (singleton groups: baseline 0), the
    result broadcast over response tokens and then whitened over all response tokens of
    the batch (token-weighted, unbiased variance, ``masked_whiten``). Shapes as ``grpo``.
    """
    _require("reinforce_plus_plus_baseline", index=index)
    scores = _sequence_scores(token_level_rewards, response_mask)
    mean, _, size = group_mean_std(scores, group_ids(index, scores.device))
    centered = scores - torch.where(size > 1, mean, 0.0)
    adv = masked_whiten(_broadcast(centered, response_mask), response_mask)
    return adv, adv


@ADV_ESTIMATORS.register("remax", requires=("reward_baselines",))
def compute_remax_outcome_advantage(*, token_level_rewards, response_mask, reward_baselines=None, **kwargs):
    """ReMax (Li et al. 2024, arXiv:2310.10505): the greedy rollout's reward as baseline.

        G_{i,t} = Σ_{t' ≥ t} r_{i,t'}        (undiscounted return-to-go)
        A_{i,t} = G_{i,t} - b_i              b_i = reward of the greedy response to prompt i

    Shapes: token_level_rewards, response_mask [B, L]; reward_baselines [B].
    Returns (A, G) [B, L].
    """
    _require("remax", reward_baselines=reward_baselines)
    rewards = torch.where(response_mask.bool(), token_level_rewards, 0.0)
    returns = rewards.flip(-1).cumsum(-1).flip(-1)
    returns = torch.where(response_mask.bool(), returns, 0.0)
    baselines = torch.as_tensor(reward_baselines, dtype=returns.dtype, device=returns.device)
    adv = returns - _broadcast(baselines, response_mask)
    return adv, returns
