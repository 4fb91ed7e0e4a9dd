"""Rotary position embedding (HF `rotate_half` layout) with cos/sin tables built once.

The tables cover positions [0, max_seq_len) and are registered buffers, allocated at
construction: a captured decode graph indexes them by position, so they must never move.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def inv_freq_for(rope: dict[str, Any], head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32 for rope types default / linear / llama3.

    Same formulas (and float32 arithmetic) as transformers' `ROPE_INIT_FUNCTIONS`.
    """
    base = float(rope["rope_theta"])
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base ** exponent)
    kind = rope["rope_type"]
    if kind == "linear":
        return inv_freq / float(rope["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, rope)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: dict[str, Any]) -> torch.Tensor:
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old_len = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Holds `cos`, `sin_signed` tables [max_seq_len, head_dim] in the model dtype.

    HF computes `x * cos + rotate_half(x) * sin` with rotate_half(x) = cat(-x2, x1).
    We store sin with the sign folded in (`cat(-sin, sin)`) so that
    rotate_half(x) * sin == roll(x, D/2) * sin_signed: three ops per call instead of six.
    """

    def __init__(self, rope: dict[str, Any], head_dim: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.half = head_dim // 2
        inv_freq = inv_freq_for(rope, head_dim)
        positions = torch.arange(max_seq_len, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # (T, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (T, D)
        sin = emb.sin()
        sin_signed = torch.cat([-sin[:, : self.half], sin[:, self.half:]], dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin_signed", sin_signed.to(dtype=dtype, device=device), persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, S] long -> (cos, sin_signed) each [B, S, 1, D] to broadcast over heads."""
        return self.cos[positions].unsqueeze(2), self.sin_signed[positions].unsqueeze(2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D]; cos/sin_signed [B, S, 1, D] -> rotated x, same shape and dtype."""
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), sin_signed)
