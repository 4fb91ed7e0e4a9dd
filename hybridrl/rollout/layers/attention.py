"""Self-attention over the static KV cache with torch SDPA.

Three modes, chosen by the `ForwardContext` the model runner builds once per forward:
- no cache (`logits()`): attend over the new k/v only (causal, optionally masked);
- prefill: right-padded prompts; k/v written to cache rows [r, r + B) (``row_start``) at
  slots [0, S) with one slice copy, attention is plain `is_causal` over the new k/v (a
  valid token never sees a pad token with right padding, so no S x S mask is built);
- extend (a prefill after a cached prefix: a continued conversation): row b's new tokens
  sit at slots ``positions[b]`` (its cached length onwards); their k/v are written there
  (an index_put_) and they attend slots [0, T) of their own cache rows (a view) through a
  bool ``[B, 1, C, T]`` mask (slot <= own position), built by the runner at the floor:
  one allocation of the mask itself, the size of the attention scores' single head;
- decode (S == 1): row b writes its k/v at slot `positions[b]` (an index_put_, no
  allocation) and attends over slots [0, kv_len) with a `[B, 1, 1, kv_len]` bool mask
  (True = attend) that hides slots beyond its own position, or no mask when every row
  sits at slot kv_len - 1 (equal-length prompts, eager mode). On CUDA with flash-attn
  (``flash_decode.py``) the runner passes ``cache_seqlens`` instead: no mask, and the
  kernel reads each row's length from the device, so a graph captured over all
  max_seq_len slots costs what the live length costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridrl.exact.attention import KEY_BLOCK, sequence_attention
from hybridrl.rollout.core.kv_cache import KVCache
from hybridrl.rollout.layers import flash_decode
from hybridrl.rollout.layers.context import LayerContext
from hybridrl.rollout.layers.linear import QKVLinear, RowParallelLinear
from hybridrl.rollout.layers.norm import RMSNorm
from hybridrl.rollout.layers.rotary import apply_rotary, apply_rotary_exact
from hybridrl.rollout.model_config import ModelConfig


@dataclass
class ForwardContext:
    positions: torch.Tensor
    """[B, S] long, RoPE positions (== cache slots)."""
    cos: torch.Tensor
    """[B, S, 1, D] rope table rows for `positions`."""
    sin_signed: torch.Tensor
    kv_cache: KVCache | None = None
    is_prefill: bool = True
    attn_mask: torch.Tensor | None = None
    """None -> causal (decode: every row attends all kv_len slots); prefill without cache: bool
    [B, 1, S, S]; decode: bool [B, 1, 1, kv_len]."""
    rows: torch.Tensor | None = None
    """decode: [B] long cache rows written by this step (arange(B))."""
    kv_len: int = 0
    """decode: number of cache slots attended."""
    slot: int | None = None
    """decode, eager, every row at the same position: that slot (a slice copy, no index_put_)."""
    row_start: int = 0
    """prefill / extend: the batch's rows are cache rows [row_start, row_start + B)."""
    extend: bool = False
    """prefill after a cached prefix: k/v go to slots ``positions``; attend [0, kv_len) with attn_mask."""
    cache_seqlens: torch.Tensor | None = None
    """decode through flash-attn: int32 [B], row b attends cache slots [0, cache_seqlens[b])
    (positions + 1, computed on the device); attn_mask and kv_len are then unused."""
    seq_lens: torch.Tensor | None = None
    """exact numerics (``LayerContext.exact``): [B] long, row b's keys are its cache slots (or
    new tokens) [0, seq_lens[b]); its first query sits at ``positions[b, 0]``."""
    visual: Any = None
    """vision-language prefill / extend / logits: the image features to place
    (``models/vision_language/inputs.py: VisualEmbeds``); None otherwise."""


class Attention(nn.Module):
    """GQA attention over this rank's heads (``ctx.tp``: ``H / T`` query heads, their KV heads;
    ``o_proj`` all-reduces the heads' partial outputs)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ctx: LayerContext):
        super().__init__()
        tp = ctx.tp
        self.layer_idx = layer_idx
        self.num_heads = tp.split(cfg.num_heads, "the attention heads")[1]
        self.num_kv_heads, self.head_dim = tp.kv_heads(cfg.num_kv_heads)[1], cfg.head_dim
        self.enable_gqa = self.num_heads != self.num_kv_heads
        self.qkv_proj = QKVLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                  ctx.child("qkv_proj"), bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, ctx.child("o_proj"),
                                        bias=cfg.o_bias, unit=cfg.head_dim, what="the attention heads")
        self.qk_norm, self.exact = cfg.qk_norm, ctx.exact
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ctx.dtype, ctx.device, ctx.exact)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ctx.dtype, ctx.device, ctx.exact)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x [B, S, hidden] -> [B, S, hidden]."""
        B, S, _ = x.shape
        H, KVH, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(B, S, H + 2 * KVH, D)
        rotate = apply_rotary_exact if self.exact else apply_rotary
        if self.qk_norm:
            q = rotate(self.q_norm(qkv[:, :, :H]), ctx.cos, ctx.sin_signed)
            k = rotate(self.k_norm(qkv[:, :, H:H + KVH]), ctx.cos, ctx.sin_signed)
        else:  # rotate q and k together: one set of rope ops per layer
            qk = rotate(qkv[:, :, :H + KVH], ctx.cos, ctx.sin_signed)
            q, k = qk[:, :, :H], qk[:, :, H:]
        v = qkv[:, :, H + KVH:]
        q = q.transpose(1, 2)  # (B, H, S, D)
        if self.exact:
            o = self._exact(q, k, v, ctx)
        elif ctx.kv_cache is not None and not ctx.is_prefill:
            o = self._decode(q, k, v, ctx)
        elif ctx.extend:
            o = self._extend(q, k, v, ctx)
        else:
            if ctx.kv_cache is not None:
                rows = slice(ctx.row_start, ctx.row_start + B)
                ctx.kv_cache.k[self.layer_idx, rows, :, :S].copy_(k.transpose(1, 2))
                ctx.kv_cache.v[self.layer_idx, rows, :, :S].copy_(v.transpose(1, 2))
            o = F.scaled_dot_product_attention(
                q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=ctx.attn_mask,
                is_causal=ctx.attn_mask is None, enable_gqa=self.enable_gqa)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, H * D))

    def _exact(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Batch-invariant attention (``hybridrl.exact.attention``: the trainer's, block by block
        from each sequence's first key) over the cache rows this forward writes, in every mode.
        q [B, H, S, D]; k, v [B, S, KVH, D] -> o [B, H, S, D]."""
        B, S = q.shape[0], q.shape[2]
        if ctx.kv_cache is None:  # logits(): each row's keys are its own new tokens from slot 0
            keys, values = k.transpose(1, 2), v.transpose(1, 2)
        else:
            k_cache, v_cache = ctx.kv_cache.k[self.layer_idx], ctx.kv_cache.v[self.layer_idx]
            r0, T = ctx.row_start, ctx.kv_len
            if not ctx.is_prefill:
                self._store_decode(k, v, k_cache, v_cache, ctx)
                r0 = 0
            elif ctx.extend:
                rows = torch.arange(r0, r0 + B, device=q.device).view(B, 1)
                k_cache[rows, :, ctx.positions] = k
                v_cache[rows, :, ctx.positions] = v
            else:
                T = S
                k_cache[r0:r0 + B, :, :S].copy_(k.transpose(1, 2))
                v_cache[r0:r0 + B, :, :S].copy_(v.transpose(1, 2))
            T = min(-(-T // KEY_BLOCK) * KEY_BLOCK, k_cache.shape[2])  # whole key blocks: no padded copy
            keys, values = k_cache[r0:r0 + B, :, :T], v_cache[r0:r0 + B, :, :T]
        return sequence_attention(q, keys, values, scale=self.head_dim ** -0.5, q_offset=ctx.positions[:, 0],
                                  k_len=ctx.seq_lens)

    def _extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """q [B, H, C, D]; k, v [B, C, KVH, D] of the new tokens -> o [B, H, C, D]."""
        B = q.shape[0]
        r0, T = ctx.row_start, ctx.kv_len
        k_cache, v_cache = ctx.kv_cache.k[self.layer_idx], ctx.kv_cache.v[self.layer_idx]
        rows = torch.arange(r0, r0 + B, device=q.device).view(B, 1)
        k_cache[rows, :, ctx.positions] = k  # (B, C) index pairs -> (B, C, KVH, D)
        v_cache[rows, :, ctx.positions] = v
        return F.scaled_dot_product_attention(q, k_cache[r0:r0 + B, :, :T], v_cache[r0:r0 + B, :, :T],
                                              attn_mask=ctx.attn_mask, enable_gqa=self.enable_gqa)

    def _decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """q [B, H, 1, D]; k, v [B, 1, KVH, D] -> o [B, H, 1, D].

        GQA runs as KVH heads of G = H / KVH query rows each (q viewed [B, KVH, G, D]): the
        kernel then reads every cached k/v row once, not G times as `enable_gqa` does
        (about 2x faster on CPU at batch 64). Same math, same result.
        """
        B, H, _, D = q.shape
        KVH = self.num_kv_heads
        k_cache, v_cache = ctx.kv_cache.k[self.layer_idx], ctx.kv_cache.v[self.layer_idx]
        self._store_decode(k, v, k_cache, v_cache, ctx)
        if ctx.cache_seqlens is not None:  # flash-attn: [B, T, KVH, D] views of the whole rows
            o = flash_decode.attend(q.transpose(1, 2), k_cache[:B].transpose(1, 2), v_cache[:B].transpose(1, 2),
                                    ctx.cache_seqlens)  # (B, 1, H, D)
            return o.transpose(1, 2)
        T = ctx.kv_len
        q, k_cache, v_cache = q.reshape(B, KVH, H // KVH, D), k_cache[:B, :, :T], v_cache[:B, :, :T]
        if q.device.type == "cpu" and B >= CPU_MATMUL_DECODE_MIN_BATCH:
            o = _matmul_attention(q, k_cache, v_cache, ctx.attn_mask)
        else:
            o = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=ctx.attn_mask)
        return o.reshape(B, H, 1, D)

    @staticmethod
    def _store_decode(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      ctx: ForwardContext) -> None:
        """Write a decode step's k, v [B, 1, KVH, D] at slot ``positions[b]`` of cache row b."""
        B = k.shape[0]
        if ctx.slot is not None:
            k_cache[:B, :, ctx.slot].copy_(k[:, 0])
            v_cache[:B, :, ctx.slot].copy_(v[:, 0])
        else:
            slots = ctx.positions[:, 0]
            k_cache[ctx.rows, :, slots] = k[:, 0]  # (B, KVH, D) into slot positions[b] of row b
            v_cache[ctx.rows, :, slots] = v[:, 0]


# Decode on CPU, measured (B=64, T=40-160, head dims 32 and 64): torch's CPU flash kernel
# costs about 2x two batched matmuls + softmax for one query row per head group; below
# batch ~8 its single call wins over three.
CPU_MATMUL_DECODE_MIN_BATCH = 8


def _matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(D), masked) v for q ``[B, KVH, G, D]``, k/v ``[B, KVH, T, D]``,
    mask None or bool ``[B, 1, 1, T]`` (True = attend; every row attends at least its own
    slot, so no row is fully masked) -> ``[B, KVH, G, D]``."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5)  # (B, KVH, G, T)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)
