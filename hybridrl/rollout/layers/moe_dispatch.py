"""Grouped dispatch of tokens to fused experts (``fused_moe.py`` holds their weights).

Dispatch (:func:`fused_experts`): the T*k (token, expert) pairs are sorted by expert
(a stable sort on the device), the tokens gathered in that order, and each projection is
one grouped GEMM over contiguous per-expert row groups whose end offsets come from a
``searchsorted`` on the device — no Python loop over tokens, no host sync, static shapes
(T*k rows whatever the routing), so a CUDA graph can capture it. The k outputs of a token
are scattered back to their (token, slot) place and summed in slot order (deterministic).

Implementations (``IMPL``): ``"grouped"`` (``torch._grouped_mm``), ``"loop"`` (one GEMM per
expert over its row group; syncs the group sizes to the host — eager only), ``"dense"``
(every expert on every token, weighted by a zero-filled [T, E] combine matrix: E/k times
the FLOPs, but capture-safe with any dtype). ``"auto"``: grouped, except that on CUDA outside
the bf16 sm90/sm100 fast path torch's grouped GEMM falls back to a host-synced loop, so
*during a CUDA-graph capture* that case takes ``"dense"``.

Exact numerics (``rollout.exact``): :func:`exact_experts`, transformers' eager loop over the
hit experts with row-tiled GEMMs (what the trainer computes under ``hybridrl.exact``).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

IMPL = "auto"  # "auto" | "grouped" | "loop" | "dense" (tests force each)


def _grouped_mm_fn():
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    return fn


@functools.cache
def _cuda_fast_grouped(device: torch.device, dtype: torch.dtype) -> bool:
    """torch's CUDA grouped GEMM runs without a host sync only for bf16 on sm90/sm100."""
    return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10)


GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what torch's grouped GEMM accepts


def _pick_impl(x: torch.Tensor) -> str:
    if IMPL != "auto":
        return IMPL
    if _grouped_mm_fn() is None or x.dtype not in GROUPED_DTYPES:
        return "dense" if _capturing(x) else "loop"
    if x.device.type == "cuda" and _capturing(x) and not _cuda_fast_grouped(x.device, x.dtype):
        return "dense"
    return "grouped"


def _capturing(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """``silu(gate) * up``; with ``limit`` (DeepSeek-V4's ``swiglu_limit``) the gate is clamped
    to ``<= limit`` and up to ``[-limit, limit]`` first."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, impl: str | None = None, limit: float | None = None) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` for every token t.

    x ``[T, H]``; w13 ``[E, 2I, H]`` (gate rows then up rows); w2 ``[E, H, I]``; topk_ids,
    topk_weights ``[T, k]`` (weights in x's dtype). An expert is ``down(swiglu(gate(x), up(x)))``
    (``limit``: the clamped SwiGLU). Returns ``[T, H]`` in x's dtype.
    """
    impl = impl or _pick_impl(x)
    if impl == "dense":
        return _dense(x, w13, w2, topk_ids, topk_weights, limit)
    T, H = x.shape
    k = topk_ids.shape[1]
    E, two_i, _ = w13.shape
    flat = topk_ids.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)  # pairs grouped by expert, token order kept
    xs = x.index_select(0, order // k)  # (T*k, H)
    if impl == "grouped":
        experts = torch.arange(E, device=x.device, dtype=sorted_ids.dtype)
        offs = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)  # group ends
        mm = _grouped_mm_fn()
        h = mm(xs, w13.transpose(1, 2), offs=offs)  # (T*k, 2I)
        a = swiglu(h[:, :two_i // 2], h[:, two_i // 2:], limit)
        y = mm(a, w2.transpose(1, 2), offs=offs)  # (T*k, H)
    elif impl == "loop":
        y = torch.empty(T * k, H, dtype=x.dtype, device=x.device)
        counts = torch.bincount(sorted_ids, minlength=E).tolist()  # host sync: eager only
        start = 0
        for e, n in enumerate(counts):
            if n:
                g, u = F.linear(xs[start:start + n], w13[e]).chunk(2, dim=-1)
                y[start:start + n] = F.linear(swiglu(g, u, limit), w2[e])
                start += n
    else:
        raise ValueError(f"fused_experts: unknown impl {impl!r}; use 'grouped', 'loop' or 'dense'")
    y = y * topk_weights.reshape(-1).index_select(0, order).unsqueeze(1)
    out = torch.empty_like(y).index_copy_(0, order, y)  # back to (token, slot) order
    return out.view(T, k, H).sum(dim=1)


def _dense(x, w13, w2, topk_ids, topk_weights, limit=None) -> torch.Tensor:
    """Every expert on every token, weighted by a [T, E] combine matrix (zeros off the top-k)."""
    E, two_i, _ = w13.shape
    combine = torch.zeros(x.shape[0], E, dtype=x.dtype, device=x.device).scatter_(1, topk_ids, topk_weights)
    out = torch.zeros_like(x)
    for e in range(E):
        g, u = F.linear(x, w13[e]).chunk(2, dim=-1)
        out += combine[:, e:e + 1] * F.linear(swiglu(g, u, limit), w2[e])
    return out


def exact_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:
    """The experts under exact numerics (``LayerContext.exact``): transformers 5.19's "eager"
    experts forward (``Qwen3MoeExperts`` / ``Qwen2MoeExperts`` / ``DeepseekV3Experts``) as
    ``hybridrl.exact.batch_invariant()`` runs it, so a token's output carries the trainer's bits.

    x ``[T, H]``; w13 ``[E, 2I, H]`` (gate rows then up rows: transformers' fused
    ``gate_up_proj``, multiplied whole as it does; one GEMM per shard would have another N,
    and the BLAS picks its kernel by the whole shape); w2 ``[E, H, I]``; topk_ids ``[T, k]``
    int64 (a token's k ids distinct); topk_weights ``[T, k]`` (x's dtype for Qwen, float32
    for DeepSeek-V3: the weighted product is then float32, cast back as transformers does).
    Returns ``[T, H]`` in x's dtype.

    Per hit expert in ascending id (transformers' loop): its (slot, token) pairs in
    transformers' order, ``down(silu(gate) * up)`` by row-tiled GEMMs, times the weight.
    transformers then ``index_add_``s each expert's rows onto zeros, so a token's output is
    ``((0 + c_e1) + c_e2) + ...`` over its experts in ascending id, one rounding per add. The
    same adds run here vectorized (the k contributions sorted by expert id, summed onto
    zeros in that order): CPU ``index_add_`` enters a parallel region even for a few rows,
    which cost ~60 ms per call on an oversubscribed 2-core host, E times per layer and step.
    """
    from hybridrl.exact.ops import padded_linear, pieced_unary

    E = w13.shape[0]
    T, k = topk_ids.shape
    y = x.new_zeros(T * k, x.shape[1])  # the contribution of (token t, slot j) at row t * k + j
    with torch.no_grad():
        mask = F.one_hot(topk_ids, num_classes=E + 1).permute(2, 1, 0)  # (E + 1, k, T)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist()  # ascending; host sync (eager)
    for e in hit:
        if e == E:
            continue
        pos, tok = torch.where(mask[e])  # (slot, token) pairs ordered slot-major, as transformers'
        gate, up = padded_linear(x[tok], w13[e]).chunk(2, dim=-1)
        h = padded_linear(pieced_unary(F.silu, gate) * up, w2[e])
        h = h * topk_weights[tok, pos, None]
        y.index_copy_(0, tok * k + pos, h.to(y.dtype))
    by_expert = topk_ids.argsort(dim=-1)  # (T, k): each token's slots in ascending expert id
    y = y.view(T, k, -1).gather(1, by_expert.unsqueeze(-1).expand(T, k, y.shape[-1]))
    out = torch.zeros_like(x)
    for j in range(k):
        out = out + y[:, j]
    return out
