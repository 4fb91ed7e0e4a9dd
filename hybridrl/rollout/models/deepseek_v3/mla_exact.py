"""Multi-head latent attention under exact numerics (``LayerContext.exact``, ``rollout.exact``).

What transformers' ``DeepseekV3Attention.forward`` computes under ``hybridrl.exact`` with the
exact attention (``exact_attention_for``), op for op, given the projections ``MlaAttention``
already ran the trainer's way (``q_proj`` or ``q_b_proj(q_a_layernorm(q_a_proj(x)))``,
``kv_a_proj_with_mqa`` -> ``kv_a_layernorm``: one row-tiled GEMM each, SIMD-path ``rsqrt``;
the rope of ``q_pe`` / ``k_pe`` with transformers' formula on SIMD-path cos / sin tables):

- the latent ``[c | rotated k_pe]`` goes to the latent cache exactly as the fast path
  writes it (prefill: slots [0, S); extend: slots ``positions``; decode: ``positions[:, 0]``);
- **the keys and values are rebuilt from the cached latent** of the row's slots [0, T):
  ``kv_b_proj`` over them (row-tiled, so a row's bits do not depend on how many rows are
  expanded with it: the trainer expands its whole packed batch in one call), split into
  ``k_nope | v`` per head, ``k = cat(k_nope, k_pe)`` shared ``k_pe`` broadcast to every head
  (transformers' ``expand_kv``: a copy into a fresh buffer, the same values);
- ``q = cat(q_nope, q_pe)``, then :func:`hybridrl.exact.attention.sequence_attention` over
  each row's keys from its sequence's first token with transformers' softmax scale (YaRN's
  mscale folded in, ``config.py``), the first query at ``positions[:, 0]``, ``seq_lens`` keys.

Never absorbed: the latent-space decode (``q_lat = W_UK^T q_nope``) sums in another order than
the trainer's expanded keys, so it cannot carry the trainer's bits. The cost is the
decompressing decode (``kv_b_proj`` over the attended slots every step), as
``decode_mode = "decompress"``; the cache is still the latent.
"""
from __future__ import annotations

import torch

from hybridrl.exact.attention import sequence_attention


def attend_exact(attn, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, ctx) -> torch.Tensor:
    """``attn``: the ``MlaAttention``; q_nope ``[B, S, H, nope]``, rotated q_pe ``[B, S, H, rope]``,
    this forward's ``latent [B, S, r + rope]`` (model dtype), ``ctx`` its ``ForwardContext``
    (``seq_lens [B]`` long: row b's keys are slots [0, seq_lens[b])) -> o ``[B, S, H, v]``."""
    keys = _store(attn.layer_idx, latent, ctx)  # (B, T, r + rope)
    key, value = expand_kv(attn, keys)
    # transformers: torch.cat((q_pass, q_rot), -1) of [B, H, S, *] views: a contiguous [B, H, S, qk]
    q = torch.cat([q_nope.transpose(1, 2), q_pe.transpose(1, 2)], dim=-1)
    o = sequence_attention(q, key, value, scale=attn.scale, q_offset=ctx.positions[:, 0], k_len=ctx.seq_lens)
    return o.transpose(1, 2)


def expand_kv(attn, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``DeepseekV3Attention.expand_kv`` on the cached latents ``keys [B, T, r + rope]``
    -> key ``[B, H, T, nope + rope]`` (contiguous), value ``[B, H, T, v]`` (a view of
    ``kv_b_proj``'s output, strided as the trainer's)."""
    B, T, _ = keys.shape
    H, nope, rope, v_dim, rank = attn.num_heads, attn.nope, attn.rope, attn.v_dim, attn.rank
    kv = attn.kv_b_proj(keys[..., :rank]).view(B, T, H, nope + v_dim).transpose(1, 2)
    k_nope, value = torch.split(kv, [nope, v_dim], dim=-1)
    k_rot = keys[..., rank:].unsqueeze(1).expand(B, H, T, rope)
    key = kv.new_empty(B, H, T, nope + rope)
    key[..., :nope].copy_(k_nope)
    key[..., nope:].copy_(k_rot)
    return key, value


def _store(layer_idx: int, latent: torch.Tensor, ctx) -> torch.Tensor:
    """Write ``latent [B, S, r + rope]`` where this forward's mode puts it (the fast path's
    slots) and return the rows' attended latents ``[B, T, r + rope]`` (slots [0, T); the new
    tokens themselves when there is no cache: ``logits()``, rows packed from slot 0)."""
    if ctx.kv_cache is None:
        return latent
    cache = ctx.kv_cache.latent[layer_idx, :, 0]  # (rows, slots, r + rope)
    B, S, _ = latent.shape
    r0, T = ctx.row_start, ctx.kv_len
    if not ctx.is_prefill:  # decode: one token per row at slot positions[b] of row b
        if ctx.slot is not None:
            cache[:B, ctx.slot].copy_(latent[:, 0])
        else:
            cache[ctx.rows, ctx.positions[:, 0]] = latent[:, 0]
        r0 = 0
    elif ctx.extend:  # after a cached prefix: row b's new tokens at slots positions[b]
        rows = torch.arange(r0, r0 + B, device=latent.device).view(B, 1)
        cache[rows, ctx.positions] = latent
    else:
        T = S
        cache[r0:r0 + B, :S].copy_(latent)
    return cache[r0:r0 + B, :T]
