"""Sampled vision tokens: a policy can sample ``<|image_pad|>``, ``<|video_pad|>`` or a vision
start / end marker like any other id (ms-swift#9287: replaying such a response crashed the
trainer). The trainer's forward takes a sampled one as text (never as an image placeholder);
these masks let a batch also keep such responses out of the loss."""

from __future__ import annotations

import torch

from hybridrl.data.vision import VisionTokens


def sampled_vision_tokens(input_ids: torch.Tensor, prompt_len: torch.Tensor | int,
                          tokens: VisionTokens) -> torch.Tensor:
    """``[B, L]`` bool: True at response positions (index >= the row's ``prompt_len``, rows
    right-padded as the step batch is) that hold one of ``tokens.special_ids``."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]  # (1, L)
    start = torch.as_tensor(prompt_len, device=input_ids.device).reshape(-1, 1)  # (B or 1, 1)
    special = torch.tensor(tokens.special_ids, device=input_ids.device)
    return (positions >= start) & torch.isin(input_ids, special)


def vision_token_response_mask(input_ids: torch.Tensor, prompt_len: torch.Tensor | int,
                               tokens: VisionTokens) -> torch.Tensor:
    """``[B]`` bool: True for the rows whose response holds no vision special token (keep them),
    False for those that sampled one; ``response_mask * mask[:, None]`` drops the latter from
    the loss. Padding must not be a vision token (pad ids are not)."""
    return ~sampled_vision_tokens(input_ids, prompt_len, tokens).any(dim=1)
