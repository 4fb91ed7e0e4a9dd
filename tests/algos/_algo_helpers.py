"""Shared builders for tests/algos: right-padded prompt+response rows with a response mask."""

import torch


def make_mask(B: int, L: int, gen: torch.Generator, *, min_resp: int = 1) -> torch.Tensor:
    """float64 [B, L]: each row = prompt (2..4 tokens) + response (min_resp..) + right padding."""
    mask = torch.zeros(B, L, dtype=torch.float64)
    for b in range(B):
        p = int(torch.randint(2, 5, (1,), generator=gen))
        r = int(torch.randint(min_resp, L - p + 1, (1,), generator=gen))
        mask[b, p:p + r] = 1.0
    return mask


def rand(shape, gen, scale=1.0):
    return torch.randn(shape, generator=gen, dtype=torch.float64) * scale


def perturb_outside(x: torch.Tensor, mask: torch.Tensor, gen: torch.Generator, scale=5.0) -> torch.Tensor:
    """Same tensor with random garbage written where mask == 0."""
    noise = torch.randn(x.shape, generator=gen, dtype=x.dtype) * scale
    return torch.where(mask.bool(), x, noise)


def last_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(mask)
    for b in range(mask.shape[0]):
        idx = mask[b].nonzero()
        if len(idx):
            out[b, idx[-1, 0]] = scores[b]
    return out
