"""Rotary position embedding (HF `rotate_half` layout) with cos/sin tables built once.

The tables cover positions [0, max_seq_len) and are registered buffers, allocated at
construction: a captured decode graph indexes them by position, so they must never move.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from hybridrl.exact.ops import pieced_unary


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
                 device: torch.device, exact: bool = False):
        """``exact``: cos / sin on the SIMD path for every position (``hybridrl.exact``), the
        values the trainer's rotary module computes under the exact mode; then
        :func:`apply_rotary_exact`."""
        super().__init__()
        self.half = head_dim // 2
        inv_freq = inv_freq_for(rope, head_dim)
        positions = torch.arange(max_seq_len, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # (T, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (T, D)
        sin = pieced_unary(torch.sin, emb) if exact else emb.sin()
        cos = pieced_unary(torch.cos, emb) if exact else emb.cos()
        sin_signed = torch.cat([-sin[:, : self.half], sin[:, self.half:]], dim=-1)
        self.register_buffer("cos", cos.to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin_signed", sin_signed.to(dtype=dtype, device=device), persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, S] long -> (cos, sin_signed) each [B, S, 1, D] to broadcast over heads."""
        return self.cos[positions].unsqueeze(2), self.sin_signed[positions].unsqueeze(2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D]; cos/sin_signed [B, S, 1, D] -> rotated x, same shape and dtype."""
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), sin_signed)


def apply_rotary_exact(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """transformers' ``q * cos + rotate_half(q) * sin`` with its roundings: two products and a
    sum, each rounded to the dtype (``addcmul`` may fuse them). ``roll(x) * sin_signed`` is
    ``rotate_half(x) * sin`` bit for bit: only signs move."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal rotary embedding (mRoPE: Qwen2.5-VL, Qwen3-VL) over the same tables.

    A token has three positions (temporal, height, width); rotary frequency ``j`` of the
    ``head_dim // 2`` turns with the position of axis ``axes[j]`` (``mrope_axes``). So the
    cos/sin row of a token is, column by column, the plain table's row at that column's
    axis position: a gather from the tables built once (graph-safe; no trigonometry per
    call), and a text token (three equal positions) gets exactly the plain rope row.
    ``exact``: the tables on the SIMD path (as the plain rope); transformers' mRoPE computes
    each axis's ``inv_freq * position`` (a K = 1 product) and its cos / sin elementwise, so
    under ``hybridrl.exact`` every column carries the gathered table's bits.
    ``tables`` takes ``[B, S]`` positions (plain rope: decode, where every axis sits at
    ``slot + delta``) or ``[3, B, S]``.
    """

    def __init__(self, rope: dict[str, Any], head_dim: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device, exact: bool = False):
        super().__init__(rope, head_dim, max_seq_len, dtype, device, exact)
        axes = mrope_axes(rope["mrope_section"], bool(rope.get("mrope_interleaved", False)), head_dim // 2)
        self.register_buffer("col_axis", torch.cat([axes, axes]).to(device), persistent=False)  # (D,)
        self.register_buffer("col", torch.arange(head_dim, device=device), persistent=False)  # (D,)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, S] or [3, B, S] long -> (cos, sin_signed) each [B, S, 1, D]."""
        if positions.dim() == 2:
            return super().tables(positions)
        D = self.col.shape[0]
        per_col = positions.permute(1, 2, 0)[..., self.col_axis]  # (B, S, D): column d's axis position
        flat = per_col * D + self.col
        return self.cos.view(-1)[flat].unsqueeze(2), self.sin_signed.view(-1)[flat].unsqueeze(2)


def mrope_axes(section: list[int], interleaved: bool, half: int) -> torch.Tensor:
    """The axis (0 = t, 1 = h, 2 = w) of each of the ``half`` rotary frequencies.

    Sectioned (Qwen2-VL / Qwen2.5-VL, transformers' ``recomposition_frequencies`` of
    ``Qwen2_5_VLRotaryEmbedding``): ``section[0]`` frequencies of t, then ``section[1]`` of
    h, then ``section[2]`` of w. Interleaved (Qwen3-VL, ``Qwen3VLTextRotaryEmbedding``):
    t h w t h w ..., frequency ``j`` is h when ``j % 3 == 1`` and ``j < 3 * section[1]``,
    w when ``j % 3 == 2`` and ``j < 3 * section[2]``, else t."""
    section = [int(s) for s in section]
    if len(section) != 3 or sum(section) != half:
        raise ValueError(f"mrope_section {section} must be 3 numbers summing to head_dim // 2 = {half}; "
                         "fix rope_parameters.mrope_section in the model config")
    axes = torch.zeros(half, dtype=torch.long)
    if interleaved:
        axes[1:3 * section[1]:3] = 1
        axes[2:3 * section[2]:3] = 2
    else:
        axes[section[0]:section[0] + section[1]] = 1
        axes[section[0] + section[1]:] = 2
    return axes


def rotary_for(rope: dict[str, Any], head_dim: int, max_seq_len: int, dtype: torch.dtype,
               device: torch.device, exact: bool = False) -> RotaryEmbedding:
    """The rope of a config: mRoPE when it has an ``mrope_section``, else the plain one."""
    if "mrope_section" in rope:
        return MRotaryEmbedding(rope, head_dim, max_seq_len, dtype, device, exact)
    return RotaryEmbedding(rope, head_dim, max_seq_len, dtype, device, exact)
