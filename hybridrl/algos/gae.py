"""Token-level return estimators: GAE (PPO with a critic) and REINFORCE++ discounted returns.

Both scan the response right to left. Positions outside ``response_mask`` are skipped
(the running quantities carry over them unchanged), so the same code serves ``[B, L]``
prompt+response rows, ``[B, R]`` response-only rows and multi-turn masks with holes.
Both return ``(advantages, returns)`` ``[B, L]``, zero outside the mask.
"""

from __future__ import annotations

import torch

from .masked import masked_whiten
from .registry import ADV_ESTIMATORS


@ADV_ESTIMATORS.register("gae", requires=("values",))
def compute_gae_advantage_return(*, token_level_rewards, response_mask, values=None, gamma: float = 1.0,
                                 lam: float = 1.0, **kwargs):
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438), as in PPO.

        δ_t = r_t + γ·V_{t+1} - V_t              (V after the last response token = 0)
        A_t = δ_t + γ·λ·A_{t+1}
        returns_t = A_t + V_t                    (the critic's regression target)
        advantages = whiten(A) over the response tokens of the batch (unbiased var, ε 1e-8)

    ``t+1`` is the next *response* position (masked positions are skipped), as verl.
    Shapes: token_level_rewards, values, response_mask [B, L]. Returns (advantages, returns) [B, L].
    """
    if values is None:
        raise ValueError("algo.adv_estimator='gae' needs critic `values` [B, L]; enable the critic or pick grpo/rloo")
    mask = response_mask.to(values.dtype)
    rewards, values = token_level_rewards.to(values.dtype), values.detach()
    next_value = values.new_zeros(values.shape[0])
    last_gae = values.new_zeros(values.shape[0])
    adv_reversed = []
    for t in reversed(range(values.shape[-1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        # where (not m·x) so that a NaN/inf at a masked position cannot leak
        next_value = torch.where(m.bool(), values[:, t], next_value)
        last_gae = torch.where(m.bool(), gae_t, last_gae)
        adv_reversed.append(last_gae)
    advantages = torch.stack(adv_reversed[::-1], dim=-1)
    returns = torch.where(response_mask.bool(), advantages + values, 0.0)
    return masked_whiten(advantages, response_mask), returns


@ADV_ESTIMATORS.register("reinforce_plus_plus")
def compute_reinforce_plus_plus_outcome_advantage(*, token_level_rewards, response_mask, gamma: float = 1.0,
                                                  **kwargs):
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted return-to-go, whitened over the batch.

        G_t = r_t + γ·G_{t+1}                    (G after the last response token = 0)
        A_t = whiten(G) over the response tokens of the batch (unbiased var, ε 1e-8)

    No baseline other than the batch mean; no grouping (works with rollout.n = 1).
    Shapes: token_level_rewards, response_mask [B, L]. Returns (A, G) [B, L].
    """
    mask = response_mask.bool()
    rewards = torch.where(mask, token_level_rewards, 0.0)
    running = rewards.new_zeros(rewards.shape[0])
    returns_reversed = []
    for t in reversed(range(rewards.shape[-1])):
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
        returns_reversed.append(running)
    returns = torch.where(mask, torch.stack(returns_reversed[::-1], dim=-1), 0.0)
    return masked_whiten(returns, response_mask), returns
