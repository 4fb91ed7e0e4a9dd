"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a latent KV cache.

Per token, MLA projects the hidden state to a *latent* ``c = norm(W_DKV x)`` of
``kv_lora_rank`` values and one decoupled RoPE key ``k_pe`` of ``qk_rope_head_dim`` values
shared by all heads (``kv_a_proj_with_mqa`` -> ``kv_a_layernorm``). ``kv_b_proj`` expands
``c`` into each head's ``k_nope`` (``qk_nope_head_dim``) and ``v`` (``v_head_dim``). The
query is ``q_proj(x)`` or, with q-LoRA, ``q_b_proj(q_a_layernorm(q_a_proj(x)))``, split into
``q_nope | q_pe``; RoPE turns ``q_pe`` and ``k_pe`` (interleaved pairs when
``rope_interleave``). The softmax scale carries YaRN's mscale.

**Cache**: ``latent [L, rows, 1, slots, kv_lora_rank + qk_rope_head_dim]`` holds
``[c | rotated k_pe]`` — what transformers' ``DeepseekV3Attention`` caches, and
``(kv_lora_rank + qk_rope_head_dim) / (2 * heads * head_dim)`` of a GQA cache of the same
heads (DeepSeek-V3: 576 values per token per layer instead of 2 * 128 * 192).

**Decode attends in latent space** (``decode_mode = "absorb"``, the default). With
``W_UK[h] [nope, r]`` and ``W_UV[h] [v, r]`` the head-h slices of ``kv_b_proj``::

    q_nope . k_nope(t) = q_nope . (W_UK[h] c_t) = (W_UK[h]^T q_nope) . c_t
    sum_t p_t v(t)     = W_UV[h] (sum_t p_t c_t)

so a decode step turns each head's query into latent space (``q_lat = W_UK^T q_nope``),
attends over the cached ``[c | k_pe]`` rows as one shared KV head (multi-query: every
cached value is read once for all heads) and maps the latent output back with ``W_UV``.
Nothing is decompressed: cost per step ~ ``T * (r + rope)`` per head instead of
``T * r * heads * (nope + v)`` for expanding the cache. ``W_UK`` (``w_uk [H, nope, r]``)
and ``W_UV^T`` (``w_uv [H, r, v]``) are **derived caches** (``rollout/derived.py``): computed
from ``kv_b_proj``'s held weight (its dequantization when FP8), refreshed in place by every
weight update after every layer is back in inference layout (their ``ready`` refuses
otherwise), and checked by the refit verifier against a fresh recomputation. A captured
CUDA graph reads them at fixed addresses.

**Exact numerics** (``ctx.exact``, ``rollout.exact``): ``mla_exact.py`` computes what
transformers' ``DeepseekV3Attention`` computes under ``hybridrl.exact``, op for op; it
always decompresses (the trainer never absorbs), from the same latent cache.

``decode_mode = "decompress"`` expands the attended cache rows through ``kv_b_proj`` every
step instead (the benchmark's comparison; same math). ``prefill_mode`` chooses the same for
prefill / extend (default "decompress", below).

**Prefill and extend decompress**: a prompt's tokens are many queries against the same
keys, so expanding the keys once (``kv_b_proj`` over the T attended latents) and running
ordinary attention with ``qk_head_dim`` keys is cheaper than absorbing (which multiplies
every query by ``W_UK`` and attends with ``r + rope``-wide keys: for DeepSeek-V3 576 vs
192 per query-key pair); ``benchmarks/rollout.py`` measures the decode side.

**Tensor parallel** splits the heads: ``q_proj`` / ``q_b_proj`` and ``kv_b_proj`` are
column-parallel by head (so are ``w_uk`` / ``w_uv``, derived from this rank's rows),
``o_proj`` row-parallel with one all-reduce; the down-projections (``q_a_proj``,
``kv_a_proj_with_mqa``) and the latent cache are whole on every rank, as in vLLM (the latent
is one shared KV head: it is replicated, like a GQA KV head when there are more ranks).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridrl.exact.ops import pieced_unary
from hybridrl.rollout.derived import DerivedCache
from hybridrl.rollout.layers.attention import CPU_MATMUL_DECODE_MIN_BATCH, ForwardContext
from hybridrl.rollout.layers.context import LayerContext
from hybridrl.rollout.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from hybridrl.rollout.layers.norm import RMSNorm
from hybridrl.rollout.model_config import ModelConfig
from hybridrl.rollout.models.deepseek_v3.mla_exact import attend_exact

DECODE_MODES = ("absorb", "decompress")


class MlaRotary(nn.Module):
    """cos / sin tables for the rope slice, built once (a captured graph indexes them).

    Interleaved (``rope_interleave``): ``[max_seq_len, rope / 2]``, one frequency per pair
    ``(x0, x1), (x2, x3), ...``; else ``[max_seq_len, rope]`` for the rotate-half layout.
    Both already multiplied by YaRN's ``attention_factor`` like transformers' tables.
    ``tables(positions)`` -> (cos, sin) ``[B, S, 1, width]`` (plain sin, not sign-folded).
    ``exact``: cos / sin on the SIMD path for every position (``hybridrl.exact``), the values
    transformers' ``DeepseekV3RotaryEmbedding`` computes under the exact mode.
    """

    def __init__(self, cfg: ModelConfig, max_seq_len: int, dtype: torch.dtype, device: torch.device,
                 exact: bool = False):
        super().__init__()
        mla = cfg.mla
        self.interleave = mla.rope_interleave
        inv_freq = torch.tensor(mla.rope_inv_freq, dtype=torch.float32)
        freqs = torch.arange(max_seq_len, dtype=torch.float32)[:, None] * inv_freq[None, :]  # (T, rope/2)
        emb = freqs if self.interleave else torch.cat([freqs, freqs], dim=-1)
        scale = mla.rope_attention_factor
        # transformers: cos(cat(freqs, freqs)) * attention_scaling in float32, then cast; the
        # interleaved form reads the first half, i.e. these values
        cos = pieced_unary(torch.cos, emb) if exact else emb.cos()
        sin = pieced_unary(torch.sin, emb) if exact else emb.sin()
        self.register_buffer("cos", (cos * scale).to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", (sin * scale).to(dtype=dtype, device=device), persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x ``[B, S, heads, rope]`` -> rotated, in transformers' output layout (the interleaved
        form returns the even-then-odd halves, as ``apply_rotary_pos_emb_interleave`` does)."""
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class MlaAttention(nn.Module):
    decode_mode = "absorb"  # or "decompress" (per instance: set_decode_mode)
    prefill_mode = "decompress"  # or "absorb" (the benchmark's comparison)

    def __init__(self, cfg: ModelConfig, layer_idx: int, ctx: LayerContext, rotary: MlaRotary):
        super().__init__()
        mla, dtype, device = cfg.mla, ctx.dtype, ctx.device
        self.layer_idx, self.num_heads = layer_idx, ctx.tp.split(cfg.num_heads, "the attention heads")[1]
        self.nope, self.rope, self.v_dim, self.rank = (mla.qk_nope_head_dim, mla.qk_rope_head_dim,
                                                       mla.v_head_dim, mla.kv_lora_rank)
        self.scale, self.exact = mla.softmax_scale, ctx.exact
        self.rotary = [rotary]  # shared with the model; a list so it is not registered twice
        H, qk = cfg.num_heads, mla.qk_head_dim
        heads = "the attention heads"  # what the column- and row-parallel projections split
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, H * qk, ctx.child("q_proj"), unit=qk, what=heads)
        else:
            self.q_a_proj = ReplicatedLinear(cfg.hidden_size, mla.q_lora_rank, ctx.child("q_a_proj"),
                                             bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6, dtype, device, ctx.exact)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, H * qk, ctx.child("q_b_proj"), unit=qk, what=heads)
        self.kv_a_proj_with_mqa = ReplicatedLinear(cfg.hidden_size, self.rank + self.rope,
                                                   ctx.child("kv_a_proj_with_mqa"), bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6, dtype, device, ctx.exact)
        self.kv_b_proj = ColumnParallelLinear(self.rank, H * (self.nope + self.v_dim), ctx.child("kv_b_proj"),
                                              unit=self.nope + self.v_dim, what=heads)
        self.kv_b_proj.adapter_capable = False  # read through the absorbed caches, not as a matmul
        self.kv_b_proj.adapter_capable_why = "MLA folds it into the absorbed attention caches W_UK / W_UV"
        self.o_proj = RowParallelLinear(H * self.v_dim, cfg.hidden_size, ctx.child("o_proj"), bias=cfg.o_bias,
                                        unit=self.v_dim, what=heads)
        H = self.num_heads  # this rank's heads from here on
        ready = lambda: self.kv_b_proj.method.in_inference_layout(self.kv_b_proj)  # noqa: E731
        DerivedCache(self, "w_uk", torch.zeros(H, self.nope, self.rank, dtype=dtype, device=device),
                     compute=lambda out: out.copy_(self._kv_b_heads()[:, :self.nope]), ready=ready)
        DerivedCache(self, "w_uv", torch.zeros(H, self.rank, self.v_dim, dtype=dtype, device=device),
                     compute=lambda out: out.copy_(self._kv_b_heads()[:, self.nope:].transpose(1, 2)), ready=ready)

    def _kv_b_heads(self) -> torch.Tensor:
        """``kv_b_proj``'s held weight ``[H, nope + v, r]`` (float32 dequantization when FP8)."""
        layer = self.kv_b_proj
        return layer.method.held(layer, slice(0, layer.output_size)).view(self.num_heads, -1, self.rank)

    # ---- projections ----------------------------------------------------------------
    def _query(self, x: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, hidden] -> q_nope [B, S, H, nope], rotated q_pe [B, S, H, rope]."""
        B, S, _ = x.shape
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, S, self.num_heads, self.nope + self.rope)
        q_pe = self.rotary[0].rotate(q[..., self.nope:], ctx.cos, ctx.sin_signed)
        return q[..., :self.nope], q_pe

    def _latent(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x [B, S, hidden] -> the cache entries ``[c | rotated k_pe]`` [B, S, r + rope]."""
        kv = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(kv[..., :self.rank])
        k_pe = self.rotary[0].rotate(kv[..., self.rank:].unsqueeze(2), ctx.cos, ctx.sin_signed)[:, :, 0]
        return torch.cat([c, k_pe], dim=-1)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x [B, S, hidden] -> [B, S, hidden]."""
        B, S, _ = x.shape
        q_nope, q_pe = self._query(x, ctx)
        latent = self._latent(x, ctx)
        if self.exact:  # the trainer's ops, decompressing the cached latent (mla_exact.py)
            o = attend_exact(self, q_nope, q_pe, latent, ctx)
            return self.o_proj(o.reshape(B, S, self.num_heads * self.v_dim))
        cache = ctx.kv_cache.latent[self.layer_idx, :, 0] if ctx.kv_cache is not None else None  # (rows, T, r+rope)
        if cache is not None and not ctx.is_prefill:
            o = self._decode(q_nope, q_pe, latent, cache, ctx)
        elif ctx.extend:
            r0, T = ctx.row_start, ctx.kv_len
            rows = torch.arange(r0, r0 + B, device=x.device).view(B, 1)
            cache[rows, ctx.positions] = latent  # (B, C) index pairs
            attend = self._absorbed if self.prefill_mode == "absorb" else self._decompressed
            o = attend(q_nope, q_pe, cache[r0:r0 + B, :T], ctx.attn_mask)
        else:
            if cache is not None:
                cache[ctx.row_start:ctx.row_start + B, :S].copy_(latent)
            attend = self._absorbed if self.prefill_mode == "absorb" else self._decompressed
            o = attend(q_nope, q_pe, latent, ctx.attn_mask)
        return self.o_proj(o.reshape(B, S, self.num_heads * self.v_dim))

    # ---- attention --------------------------------------------------------------------
    def _decompressed(self, q_nope, q_pe, latent, mask) -> torch.Tensor:
        """Queries [B, S, H, *] against the expanded keys/values of ``latent [B, T, r + rope]``
        (causal when ``mask`` is None) -> [B, S, H, v]."""
        B, T, _ = latent.shape
        kv = self.kv_b_proj(latent[..., :self.rank]).view(B, T, self.num_heads, self.nope + self.v_dim)
        k_pe = latent[..., self.rank:].unsqueeze(2).expand(B, T, self.num_heads, self.rope)
        k = torch.cat([kv[..., :self.nope], k_pe], dim=-1).transpose(1, 2)  # (B, H, T, qk)
        v = kv[..., self.nope:].transpose(1, 2)  # (B, H, T, v)
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)  # (B, H, S, qk)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and q.shape[2] > 1,
                                           scale=self.scale)
        return o.transpose(1, 2)

    def _decode(self, q_nope, q_pe, latent, cache, ctx: ForwardContext) -> torch.Tensor:
        """One token per row: write its latent at its slot, attend slots [0, kv_len) -> [B, 1, H, v]."""
        B = q_nope.shape[0]
        if ctx.slot is not None:
            cache[:B, ctx.slot].copy_(latent[:, 0])
        else:
            cache[ctx.rows, ctx.positions[:, 0]] = latent[:, 0]
        rows = cache[:B, :ctx.kv_len]  # (B, T, r + rope)
        if self.decode_mode == "decompress":
            return self._decompressed(q_nope, q_pe, rows, ctx.attn_mask)
        return self._absorbed(q_nope, q_pe, rows, ctx.attn_mask)

    def _absorbed(self, q_nope, q_pe, latent, mask) -> torch.Tensor:
        """Queries [B, S, H, *] attend ``latent [B, T, r + rope]`` in latent space -> [B, S, H, v]
        (causal when ``mask`` is None and S > 1). The cached rows are one KV head shared by
        all H query heads: q_lat = W_UK^T q_nope, scores over [c | k_pe], o = W_UV o_lat."""
        B, S, H, _ = q_nope.shape
        q_lat = torch.matmul(q_nope.transpose(1, 2), self.w_uk.unsqueeze(0))  # (B, H, S, r)
        q = torch.cat([q_lat, q_pe.transpose(1, 2)], dim=-1).reshape(B, 1, H * S, -1)  # heads x queries as rows
        k, v = latent.unsqueeze(1), latent[..., :self.rank].unsqueeze(1)  # (B, 1, T, r + rope), (B, 1, T, r)
        if mask is None and S > 1:  # causal: query s of every head sees keys [0, T - S + s]
            T = latent.shape[1]
            mask = (torch.arange(T, device=q.device).view(1, T) <= torch.arange(T - S, T, device=q.device).view(S, 1))
            mask = mask.view(1, 1, 1, S, T).expand(1, 1, H, S, T).reshape(1, 1, H * S, T)
        elif mask is not None and mask.shape[-2] > 1:  # [B, 1, S, T] -> every head's rows
            mask = mask.unsqueeze(2).expand(B, 1, H, S, mask.shape[-1]).reshape(B, 1, H * S, -1)
        if q.device.type == "cpu" and B >= CPU_MATMUL_DECODE_MIN_BATCH and S == 1:
            scores = torch.matmul(q, k.transpose(-1, -2)).mul_(self.scale)  # (B, 1, H, T)
            if mask is not None:
                scores.masked_fill_(~mask, float("-inf"))
            o_lat = torch.matmul(torch.softmax(scores, dim=-1), v)
        else:
            o_lat = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        o = torch.matmul(o_lat.view(B, H, S, self.rank), self.w_uv.unsqueeze(0))  # (B, H, S, v)
        return o.transpose(1, 2)


def set_decode_mode(model: nn.Module, mode: str, *, prefill: bool = False) -> None:
    """Every MLA layer of ``model`` decodes (``prefill=True``: prefills) by ``mode``
    ("absorb" or "decompress")."""
    if mode not in DECODE_MODES:
        raise ValueError(f"MLA decode mode {mode!r}: use one of {DECODE_MODES}")
    for m in model.modules():
        if isinstance(m, MlaAttention):
            setattr(m, "prefill_mode" if prefill else "decode_mode", mode)
