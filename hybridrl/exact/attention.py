"""Batch-invariant causal attention: one query's output depends on its own sequence's keys
only, with the same reduction order whether it is computed in a decode step (one query
against the cache) or in the trainer's whole-sequence forward.

The keys of a sequence are cut into ``KEY_BLOCK``-wide blocks counted from the
sequence's first token. Per block: scores by a GEMM of fixed shape (queries padded to a
multiple of ``ROW_TILE`` rows, ``KEY_BLOCK`` columns), masked to ``-inf`` beyond the
query's position; the softmax's max over all blocks (exact in any order); then
``exp(s - max)``, its row sum and its product with the block's values, each accumulated
block after block in order. Blocks a query cannot see contribute exact zeros, so a
trainer row that runs past the decode step's last block adds ``+0`` and keeps the bits.
The math runs in float32 (bf16 q/k/v are upcast, the output cast back): the same on both
sides, so exact in either dtype.

Registered with transformers as :data:`EXACT_ATTN` (``AttentionInterface``), it serves the
trainer's packed forward (one row, ``cu_seq_lens_q`` kwargs: each sequence alone); the
built-in engine calls :func:`sequence_attention` over each row's cache slots
(``rollout/layers/attention.py``, ``models/deepseek_v3/mla_exact.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from hybridrl.exact.ops import ROW_TILE, pieced_unary

KEY_BLOCK = 64
EXACT_ATTN = "hybridrl_exact"


def sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                       q_offset: torch.Tensor, k_len: torch.Tensor) -> torch.Tensor:
    """Causal attention of batched sequences in the block order above.

    q ``[N, H, Lq, D]``; k ``[N, KVH, Lk, D]``, v ``[N, KVH, Lk, Dv]``, each row's keys from
    its sequence's first token (slot 0 = position 0); ``q_offset [N]`` long: the position of
    row n's first query (query j sits at ``q_offset + j`` and attends keys ``<= q_offset + j``);
    ``k_len [N]``: row n's valid keys. Returns ``[N, H, Lq, Dv]`` in q's dtype. Keys at or
    past ``k_len`` are masked before the softmax, so they may hold any finite values (the
    engine passes whole 64-slot blocks of its cache, zero-initialized, finite); a block
    is never copied when ``Lk`` is a multiple of ``KEY_BLOCK`` in float32.

    The ``G = H / KVH`` query heads of a KV head are stacked as ``G * Lq`` rows of one GEMM
    against that head's keys (no ``repeat_interleave`` of k and v), padded to a multiple of
    ``ROW_TILE`` rows: a one-token decode step pays ``ROW_TILE / G`` rows per head instead of
    ``ROW_TILE`` (measured 4.8x faster at 256 rows of 4/2 heads), with the very bits of
    the per-head layout (every row count is a multiple of ``ROW_TILE``; tested).
    """
    N, H, Lq, D = q.shape
    KVH, Lk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G, out_dtype, dev = H // KVH, q.dtype, q.device
    R = G * Lq
    rows = R + (-R % ROW_TILE)
    qf = q.new_zeros(N, KVH, rows, D, dtype=torch.float32)
    qf[:, :, :R].view(N, KVH, G, Lq, D).copy_(q.view(N, KVH, G, Lq, D))
    width = -(-Lk // KEY_BLOCK) * KEY_BLOCK
    if Lk == width and k.dtype == v.dtype == torch.float32:  # whole blocks already (the engine's cache view)
        kf, vf = k, v
    else:
        kf = k.new_zeros(N, KVH, width, D, dtype=torch.float32)
        vf = v.new_zeros(N, KVH, width, Dv, dtype=torch.float32)
        kf[:, :, :Lk], vf[:, :, :Lk] = k, v
    q_pos = q_offset.view(N, 1) + (torch.arange(rows, device=dev) % max(Lq, 1)).view(1, rows)  # (N, rows)
    limit = torch.minimum(q_pos, k_len.view(N, 1) - 1).view(N, 1, rows, 1)  # last key each query may see
    key_pos = torch.arange(width, device=dev).view(1, 1, 1, width)
    scores = []
    for cols in (slice(b, b + KEY_BLOCK) for b in range(0, width, KEY_BLOCK)):
        s = torch.matmul(qf, kf[:, :, cols].transpose(-1, -2)).mul_(scale)  # (N, KVH, rows, KEY_BLOCK)
        scores.append(s.masked_fill_(key_pos[..., cols] > limit, float("-inf")))
    m = scores[0].amax(-1)
    for s in scores[1:]:
        m = torch.maximum(m, s.amax(-1))
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).unsqueeze(-1)  # padded query rows see nothing
    denom = qf.new_zeros(N, KVH, rows)
    acc = qf.new_zeros(N, KVH, rows, Dv)
    for b, s in enumerate(scores):
        if R < rows:  # a decode step: exp of the real rows only (a padded row's p is 0 and dropped)
            p = torch.zeros_like(s)
            p[:, :, :R] = pieced_unary(torch.exp, s[:, :, :R] - m[:, :, :R])
        else:
            p = pieced_unary(torch.exp, s - m)  # every element on the SIMD path; not in place: amax saved s
        denom = denom + p.sum(-1)
        acc = acc + torch.matmul(p, vf[:, :, b * KEY_BLOCK:(b + 1) * KEY_BLOCK])
    out = acc / denom.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1)
    return out[:, :, :R].reshape(N, KVH, G, Lq, Dv).reshape(N, H, Lq, Dv).to(out_dtype)


def _attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """AttentionInterface: q ``[B, H, Lq, D]``, k/v ``[B, KVH, Lk, D]`` -> ``([B, Lq, H, Dv], None)``."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None and query.shape[0] == 1:  # the trainer's packed row: each sequence alone
        outs = []
        bounds = cu.tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            zero = torch.zeros(1, dtype=torch.long, device=query.device)
            o = sequence_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], scale=scale,
                                   q_offset=zero, k_len=zero + (b - a))
            outs.append(o)
        return torch.cat(outs, dim=2).transpose(1, 2), None
    raise ValueError(f"{EXACT_ATTN} attention needs cu_seq_lens_q (one packed row of sequences); call it through "
                     "the trainer's packed forward (hybridrl/attention/hf_varlen.py)")


def register() -> None:
    """Register :data:`EXACT_ATTN` with transformers (idempotent)."""
    from hybridrl.attention.hf_attention import register_maskless

    register_maskless(EXACT_ATTN, _attention_forward)


@contextlib.contextmanager
def exact_attention_for(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` with :data:`EXACT_ATTN` inside the block, and MoE experts as their
    per-expert ``F.linear`` loop ("eager": ``grouped_mm`` is not row-padded, so a token's
    expert output would depend on how many tokens share the expert); restoring both after."""
    from hybridrl.attention.hf_attention import attention_implementation

    register()
    experts = getattr(model.config, "_experts_implementation", None)
    switch = experts not in (None, "eager")
    with attention_implementation(model, EXACT_ATTN):
        if switch:
            model.set_experts_implementation("eager")
        try:
            yield
        finally:
            if switch:
                model.set_experts_implementation(experts)
