"""DAPO extras (Yu et al. 2025, arXiv:2503.14476): overlong reward shaping, masking of
truncated responses ("overlong filtering"), and dynamic sampling.

(Clip-higher is ``clip_ratio_high > clip_ratio_low`` in the ``vanilla`` policy loss; the
token-level loss is ``loss_agg_mode="token-mean"``.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .masked import group_ids


def overlong_reward_penalty(response_lengths, *, max_response_length: int, overlong_buffer_len: int,
                            overlong_penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO soft overlong punishment (eq. 13), scaled by ``overlong_penalty_factor`` = f:

        R_len(|y|) = 0                                  |y| ≤ L_max - L_cache
                   = f · ((L_max - L_cache) - |y|) / L_cache    L_max - L_cache < |y| ≤ L_max
                   = -f                                 |y| > L_max

    L_max = ``max_response_length``, L_cache = ``overlong_buffer_len``. ``response_lengths [B]``
    → penalty [B] (≤ 0) to add to the score before it is placed on the last token.
    """
    if not 0 < overlong_buffer_len <= max_response_length:
        raise ValueError(f"algo.overlong_buffer_len={overlong_buffer_len}: need 0 < it <= max response length "
                         f"({max_response_length}); set 0 in the config to turn shaping off")
    lengths = torch.as_tensor(response_lengths, dtype=torch.float32)
    expected = max_response_length - overlong_buffer_len
    penalty = (expected - lengths) / overlong_buffer_len * overlong_penalty_factor
    return penalty.clamp(min=-overlong_penalty_factor, max=0.0)


def mask_truncated_responses(response_mask: torch.Tensor, *, finish_reasons: Sequence[str] | None = None,
                             response_lengths=None, max_response_length: int | None = None):
    """DAPO overlong filtering: drop truncated responses from the loss.

    Truncated = ``finish_reasons[i] == "length"`` or, without finish reasons,
    ``response_lengths[i] >= max_response_length``. Returns (mask [B, L], truncated [B] bool).
    """
    if finish_reasons is not None:
        truncated = torch.tensor([reason == "length" for reason in finish_reasons], dtype=torch.bool)
    elif response_lengths is not None and max_response_length is not None:
        truncated = torch.as_tensor(response_lengths) >= max_response_length
    else:
        raise ValueError("mask_truncated_responses: pass finish_reasons=..., or response_lengths= and "
                         "max_response_length=")
    truncated = truncated.to(response_mask.device)
    return response_mask * (~truncated).unsqueeze(-1).to(response_mask.dtype), truncated


def dynamic_sampling_keep(scores, index: Sequence | torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling: row indices (ascending, long ``[K]``) of the groups whose scores
    are not all equal (0 < accuracy < 1 for 0/1 rewards). One-sample groups are kept (as verl).
    The loop keeps sampling until it has enough kept groups.
    """
    scores = torch.as_tensor(scores).detach().to("cpu", torch.float64).reshape(-1)
    gid = group_ids(index, scores.device)
    num_groups = int(gid.max()) + 1 if gid.numel() else 0
    gmax = torch.full((num_groups,), -torch.inf, dtype=scores.dtype).scatter_reduce(0, gid, scores, "amax")
    gmin = torch.full((num_groups,), torch.inf, dtype=scores.dtype).scatter_reduce(0, gid, scores, "amin")
    size = torch.zeros(num_groups, dtype=torch.long).index_add(0, gid, torch.ones_like(gid))
    keep_group = (gmax > gmin) | (size == 1)
    return torch.nonzero(keep_group[gid]).squeeze(-1)
