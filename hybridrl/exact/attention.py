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

Registered with transformers as :data:`EXACT_ATTN` (``AttentionInterface``), it serves:

- the trainer's packed forward (one row, ``cu_seq_lens_q`` kwargs: each sequence alone);
- the exact engine's left-padded batches (``exact_key_starts [B]`` kwarg: row b's
  sequence starts at key slot ``start_b``; its queries are the last ``Lq`` slots).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from hybridrl.exact.ops import ROW_TILE

KEY_BLOCK = 64
EXACT_ATTN = "hybridrl_exact"


def sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                       q_offset: torch.Tensor, k_len: torch.Tensor) -> torch.Tensor:
    """Causal attention of batched sequences in the block order above.

    q ``[N, H, Lq, D]``; k ``[N, KVH, Lk, D]``, v ``[N, KVH, Lk, Dv]``, each row's keys from
    its sequence's first token (slot 0 = position 0); ``q_offset [N]`` long: the position of
    row n's first query (query j sits at ``q_offset + j`` and attends keys ``<= q_offset + j``);
    ``k_len [N]``: row n's valid keys. Returns ``[N, H, Lq, Dv]`` in q's dtype.
    """
    N, H, Lq, D = q.shape
    KVH, Lk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    out_dtype = q.dtype
    rows = Lq + (-Lq % ROW_TILE)
    qf = q.float()
    if rows != Lq:
        qf = torch.cat([qf, qf.new_zeros(N, H, rows - Lq, D)], dim=2)
    blocks = -(-Lk // KEY_BLOCK)
    pad = blocks * KEY_BLOCK - Lk
    kf, vf = k.float(), v.float()
    if pad:
        kf = torch.cat([kf, kf.new_zeros(N, KVH, pad, D)], dim=2)
        vf = torch.cat([vf, vf.new_zeros(N, KVH, pad, Dv)], dim=2)
    if H != KVH:
        kf, vf = kf.repeat_interleave(H // KVH, dim=1), vf.repeat_interleave(H // KVH, dim=1)
    q_pos = q_offset.view(N, 1, 1) + torch.arange(rows, device=q.device).view(1, rows, 1)  # (N, rows, 1)
    limit = torch.minimum(q_pos, k_len.view(N, 1, 1) - 1)  # last key each query may see
    scores = []
    for b in range(blocks):
        cols = slice(b * KEY_BLOCK, (b + 1) * KEY_BLOCK)
        s = torch.matmul(qf, kf[:, :, cols].transpose(-1, -2)) * scale  # (N, H, rows, KEY_BLOCK)
        key_pos = torch.arange(b * KEY_BLOCK, (b + 1) * KEY_BLOCK, device=q.device).view(1, 1, KEY_BLOCK)
        scores.append(s.masked_fill(~(key_pos <= limit).unsqueeze(1), float("-inf")))
    m = scores[0].amax(-1)
    for s in scores[1:]:
        m = torch.maximum(m, s.amax(-1))
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # padded query rows see nothing
    denom = qf.new_zeros(N, H, rows)
    acc = qf.new_zeros(N, H, rows, Dv)
    for b, s in enumerate(scores):
        p = torch.exp(s - m.unsqueeze(-1))
        denom = denom + p.sum(-1)
        acc = acc + torch.matmul(p, vf[:, :, b * KEY_BLOCK:(b + 1) * KEY_BLOCK])
    out = acc / denom.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1)
    return out[:, :, :Lq].to(out_dtype)


def _attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """AttentionInterface: q ``[B, H, Lq, D]``, k/v ``[B, KVH, Lk, D]`` -> ``([B, Lq, H, Dv], None)``."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    cu = kwargs.get("cu_seq_lens_q")
    starts = kwargs.get("exact_key_starts")
    if cu is not None and query.shape[0] == 1:  # the trainer's packed row: each sequence alone
        outs = []
        bounds = cu.tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            zero = torch.zeros(1, dtype=torch.long, device=query.device)
            o = sequence_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], scale=scale,
                                   q_offset=zero, k_len=zero + (b - a))
            outs.append(o)
        return torch.cat(outs, dim=2).transpose(1, 2), None
    if starts is None:
        raise ValueError(f"{EXACT_ATTN} attention needs cu_seq_lens_q (a packed row) or exact_key_starts "
                         "(left-padded rows); call it through the trainer's forward or the exact engine")
    B, _, Lq, _ = query.shape
    Lk = key.shape[2]
    starts = starts.to(query.device).long()
    # left-align each row's keys at its sequence start (slot start_b -> 0)
    idx = (torch.arange(Lk, device=query.device).view(1, Lk) + starts.view(B, 1)).clamp(max=Lk - 1)
    k_al = key.gather(2, idx.view(B, 1, Lk, 1).expand(-1, key.shape[1], -1, key.shape[-1]))
    v_al = value.gather(2, idx.view(B, 1, Lk, 1).expand(-1, value.shape[1], -1, value.shape[-1]))
    k_len = Lk - starts
    out = sequence_attention(query, k_al, v_al, scale=scale, q_offset=k_len - Lq, k_len=k_len)
    return out.transpose(1, 2), None


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
