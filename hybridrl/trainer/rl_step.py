"""From rollouts and scores to the tensors the actor update needs (advantages, KL, TIS).

Pure orchestration of ``hybridrl.algos`` functions on one batch; no model here except
through the callables passed in.
"""

from __future__ import annotations

import torch

from hybridrl import algos


def response_lengths(response_mask: torch.Tensor) -> torch.Tensor:
    return response_mask.sum(-1)


def shape_scores(scores: torch.Tensor, *, lengths: torch.Tensor, max_tokens: int, overlong_buffer_len: int,
                 overlong_penalty_factor: float) -> torch.Tensor:
    """DAPO soft overlong punishment added to the scores (when the buffer is > 0)."""
    if overlong_buffer_len <= 0:
        return scores
    return scores + algos.overlong_reward_penalty(
        lengths, max_response_length=max_tokens, overlong_buffer_len=overlong_buffer_len,
        overlong_penalty_factor=overlong_penalty_factor)


def compute_advantages(*, adv_estimator: str, scores: torch.Tensor, response_mask: torch.Tensor, index: list[int],
                       norm_adv_by_std_in_grpo: bool, gamma: float, lam: float,
                       values: torch.Tensor | None = None, reward_baselines: torch.Tensor | None = None,
                       token_level_rewards: torch.Tensor | None = None):
    """``(advantages, returns)`` ``[B, L]`` by the registered estimator."""
    if token_level_rewards is None:
        token_level_rewards = algos.scores_to_token_level_rewards(scores, response_mask)
    fn = algos.get_adv_estimator(adv_estimator)
    return fn(token_level_rewards=token_level_rewards, response_mask=response_mask, index=index,
              norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, gamma=gamma, lam=lam, values=values,
              reward_baselines=reward_baselines)
