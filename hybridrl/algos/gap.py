"""The rollout/trainer log-prob gap of one batch, and the same numbers by position and by
token entropy.

``r_t = logp_trainer(y_t) - logp_rollout(y_t)`` over response tokens. The token KL is the
k3 estimator of KL(pi_rollout || pi_trainer) from tokens the rollout sampled,
``mean(exp(r) - 1 - r)`` (>= 0, ~ r^2 / 2 for small gaps), so independent causes of a
gap add up in it (their r's are uncorrelated, their squares add).
"""

from __future__ import annotations

import torch

POSITION_EDGES = (0, 4, 16, 64, 256, 10**9)
ENTROPY_EDGES = (0.0, 0.1, 0.5, 1.0, 2.0, float("inf"))


def token_gap(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """``{"kl", "max_abs", "frac_over_1e-3", "tokens"}`` over ``mask`` (``[B, L]`` each)."""
    m = mask.bool()
    r = (trainer.double() - rollout.double())[m]
    if r.numel() == 0:
        return {"kl": 0.0, "max_abs": 0.0, "frac_over_1e-3": 0.0, "tokens": 0}
    r = r.clamp(-20, 20)
    return {"kl": float((r.exp() - 1 - r).mean()), "max_abs": float(r.abs().max()),
            "frac_over_1e-3": float((r.abs() > 1e-3).double().mean()), "tokens": int(r.numel())}


def gap_by(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, key: torch.Tensor,
           edges: tuple) -> list[dict]:
    """:func:`token_gap` per bin ``edges[i] <= key < edges[i+1]`` of a per-token ``key [B, L]``."""
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = mask.bool() & (key >= lo) & (key < hi)
        if sel.any():
            rows.append({"from": lo, "to": hi, **token_gap(trainer, rollout, sel)})
    return rows


def response_positions(response_mask: torch.Tensor) -> torch.Tensor:
    """``[B, L]``: 0 for a row's first response token, 1 for the next, ... (-1 elsewhere)."""
    m = response_mask.bool()
    return torch.where(m, m.long().cumsum(-1) - 1, torch.full_like(m, -1, dtype=torch.long))
