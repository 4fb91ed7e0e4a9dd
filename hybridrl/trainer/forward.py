"""The trainer's log-prob / entropy forward: padding-free backbone, response-only,
vocabulary-chunked lm_head.

Three memory sinks of the textbook ``model(input_ids, attention_mask).logits`` forward
are removed here:

1. **Padding.** Rows are packed (no pad tokens computed) and attention runs per sequence
   without an S×S mask (``ForwardOptions.attn_backend``, see :func:`compute_logprobs_entropy`).
2. **Prompt logits.** The lm_head runs only at the positions that predict response
   tokens (hidden state at t-1 predicts token t).
3. **Full ``[tokens, vocab]`` float32 logits.** :class:`_ChunkedLogprobEntropy` computes
   logits ``chunk`` tokens at a time and keeps only per-token log-sum-exp and entropy; its
   backward recomputes each chunk's logits, so neither pass holds more than one chunk.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridrl.attention.hf_varlen import varlen_attention_for
from hybridrl.attention.packing import make_microbatches, unpad, unpad_indices
from hybridrl.attention.varlen import flash_attn_usable
from hybridrl.data.vision import RowImages
from hybridrl.trainer.v4_indexer import engine_selection
from hybridrl.trainer.vision_forward import (language_model, vision_tokens_of, vl_group_hidden,
                                             vl_padded_hidden)

ATTN_BACKENDS = ("auto", "varlen", "block_diagonal", "bucketed")
# CPU choice, measured: for long rows (benchmarks/packing.py, lengths U[16, 512]) one
# packed row with the per-sequence SDPA loop ("varlen") beat length-bucketed micro-batches
# and the block-diagonal mask (which pays T² attention). For many short rows (the RL
# default: 256 rows of ~12 tokens) the per-sequence Python loop costs 10-30x more than
# the attention itself, and length-sorted padded buckets (is_causal, no mask) win.
CPU_VARLEN_MIN_MEAN_LEN = 128
DEFAULT_BUCKET_TOKENS = 8192


@dataclass(frozen=True, kw_only=True)
class ForwardOptions:
    """Options of :func:`compute_logprobs_entropy`: the distribution scored (``temperature``),
    whether entropy is returned, and how the forward runs (padded or packed, lm_head
    chunk, token budget per backbone call, attention backend). Frozen, keyword-only.

    temperature: logits are divided by it; 0 means greedy, scored at 1.
    packed: False runs the plain padded forward (the reference).
    vocab_chunk_tokens: tokens per lm_head chunk (bounds ``[chunk, V]`` float32).
    compute_entropy: False returns zeros for entropy (computed anyway, it is cheap next to
        the logits; kept for the contract).
    max_tokens_per_microbatch: token budget per backbone call (length-sorted, see
        ``make_microbatches``); None = all rows in one call (bucketed: 8192).
    attn_backend: ``"varlen"`` (one packed row, flash-attn varlen or per-sequence SDPA),
        ``"block_diagonal"`` (one packed row, transformers' T×T mask), ``"bucketed"``
        (length-sorted padded micro-batches, is_causal, no mask) or ``"auto"`` (varlen on
        CPU and with flash-attn on CUDA, else bucketed); see ``ATTN_BACKENDS``.
    """

    temperature: float = 1.0
    packed: bool = True
    vocab_chunk_tokens: int = 1024
    compute_entropy: bool = True
    max_tokens_per_microbatch: int | None = None
    attn_backend: str = "auto"


class _ChunkedLogprobEntropy(torch.autograd.Function):
    """``log_softmax(h @ W.T + b) / T)[target]`` and its entropy, ``chunk`` rows at a time.

    hidden ``[N, D]`` (model dtype), weight ``[V, D]``, bias ``[V]`` or None, targets
    ``[N]`` long -> logprobs ``[N]`` float32, entropy ``[N]`` float32.
    """

    @staticmethod
    def _logq(hidden, weight, bias, temperature):
        # Logits in the model dtype (as the lm_head would), softmax math in float32.
        z = F.linear(hidden, weight, bias)
        z = z.to(torch.promote_types(z.dtype, torch.float32))  # (n, V); float64 stays (tests)
        if temperature != 1.0:
            z.div_(temperature)
        lse = torch.logsumexp(z, dim=-1)  # (n,)
        return z.sub_(lse.unsqueeze(1))  # log q, in place  (n, V)

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk):
        n_tokens = hidden.shape[0]
        acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
        logp = torch.empty(n_tokens, dtype=acc_dtype, device=hidden.device)
        entropy = torch.empty_like(logp)
        for s in range(0, n_tokens, chunk):
            logq = _ChunkedLogprobEntropy._logq(hidden[s : s + chunk], weight, bias, temperature)
            logp[s : s + chunk] = logq.gather(1, targets[s : s + chunk, None]).squeeze(1)
            probs = logq.exp()  # (n, V)
            entropy[s : s + chunk] = -(probs.unsqueeze(1) @ logq.unsqueeze(2)).view(-1)  # no (n, V) product
        ctx.save_for_backward(hidden, weight, bias, targets, entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, entropy = ctx.saved_tensors
        if grad_logp is None:
            grad_logp = torch.zeros_like(entropy)
        if grad_entropy is None:
            grad_entropy = torch.zeros_like(entropy)
        want_w = ctx.needs_input_grad[1]
        want_b = bias is not None and ctx.needs_input_grad[2]
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        acc = torch.promote_types(weight.dtype, torch.float32)  # accumulate low-precision grads in fp32
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        grad_bias = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if want_b else None
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s : s + ctx.chunk]
            g_lp = grad_logp[s : s + ctx.chunk, None]  # (n, 1)
            g_h = grad_entropy[s : s + ctx.chunk, None]
            logq = _ChunkedLogprobEntropy._logq(h, weight, bias, ctx.temperature)  # (n, V)
            probs = logq.exp()
            # d logp / dz = onehot - p;  d H / dz = -p * (log q + H).  In place on logq, probs.
            logq.add_(entropy[s : s + ctx.chunk, None]).mul_(g_h).add_(g_lp)
            grad_z = probs.mul_(logq).neg_()
            grad_z.scatter_add_(1, targets[s : s + ctx.chunk, None], g_lp)
            if ctx.temperature != 1.0:
                grad_z.div_(ctx.temperature)  # z = logits / T
            if grad_hidden is not None:
                grad_hidden[s : s + ctx.chunk] = (grad_z.to(weight.dtype) @ weight).to(hidden.dtype)
            if want_w:
                grad_weight.addmm_(grad_z.t(), h.to(acc))
            if want_b:
                grad_bias += grad_z.sum(0)
        grad_weight = grad_weight.to(weight.dtype) if want_w else None
        grad_bias = grad_bias.to(bias.dtype) if want_b else None
        return grad_hidden, grad_weight, grad_bias, None, None, None


def chunked_logprobs_entropy(
    hidden: torch.Tensor,
    lm_head: torch.nn.Linear,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-prob of ``targets`` and entropy under ``lm_head(hidden) / temperature``.

    hidden ``[N, D]``, targets ``[N]`` long -> (``[N]`` float32, ``[N]`` float32); peak extra
    memory about ``3 * chunk_tokens * V * 4`` bytes in forward and backward.
    """
    if chunk_tokens <= 0:
        raise ValueError(f"vocab_chunk_tokens must be > 0, got {chunk_tokens}.")
    temperature = 1.0 if temperature == 0 else float(temperature)  # greedy reports log_softmax(logits)
    return _ChunkedLogprobEntropy.apply(hidden, lm_head.weight, lm_head.bias, targets, temperature, chunk_tokens)


def _backbone(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, model.base_model_prefix)


def _packed_hidden(model, ids_g, mask_g, backend, routed_g=None, moe=None) -> torch.Tensor:
    """Hidden states ``[T_g, D]`` of one micro-batch's real tokens, in unpad order.
    ``routed_g [n, L, layers, k]``: recorded expert ids of these rows (MoE replay)."""
    u = unpad_indices(mask_g)
    ids = unpad(ids_g, u)  # (T_g,)
    backbone = _backbone(model)
    extra = {"output_router_logits": True} if moe is not None and moe.wants_logits else {}
    real_routing = None if routed_g is None else routed_g[mask_g.bool()]  # (T_g, layers, k), unpad order
    if backend == "bucketed":
        # Re-pad right-aligned to this group's longest row: right padding + is_causal is
        # exact for real tokens (they never see a later pad), so no mask at all.
        lengths = u.cu_seqlens.diff().long()
        row = torch.repeat_interleave(torch.arange(len(lengths), device=ids.device), lengths)
        flat = row * u.max_seqlen + u.position_ids  # (T_g,) into (n, L_g)
        dense = ids.new_zeros(len(lengths) * u.max_seqlen).index_put_((flat,), ids)
        dense = dense.view(len(lengths), u.max_seqlen)  # (n, L_g)
        routing = None
        if real_routing is not None:  # the dense layout's routing: recorded at real tokens, -1 at pads
            routing = real_routing.new_full((dense.numel(), *real_routing.shape[1:]), -1)
            routing = routing.index_put((flat,), real_routing)
        with (moe.replay(model, routing) if moe is not None else contextlib.nullcontext()):
            out = backbone(input_ids=dense, use_cache=False, **extra)
        if extra:
            moe.router_logits.append(tuple(r[flat] for r in out.router_logits))
        return out.last_hidden_state.flatten(0, 1)[flat]  # (T_g, D)
    kwargs = {}
    if backend == "varlen":
        kwargs = dict(
            cu_seq_lens_q=u.cu_seqlens, cu_seq_lens_k=u.cu_seqlens, max_length_q=u.max_seqlen, max_length_k=u.max_seqlen
        )
    # block_diagonal: transformers sees restarting position_ids with no 2D mask and builds
    # a [1, 1, T, T] block-diagonal causal mask itself.
    with (moe.replay(model, real_routing) if moe is not None else contextlib.nullcontext()):
        out = backbone(input_ids=ids[None], position_ids=u.position_ids[None], use_cache=False, **kwargs, **extra)
    if extra:
        moe.router_logits.append(tuple(out.router_logits))
    return out.last_hidden_state[0]  # (T_g, D)


# Models whose attention cannot run packed: DeepSeek-V4's compressors cut windows from each
# row's position 0 and transformers runs it eagerly only (measured: a packed second sequence
# is wrong by up to 2.2 in logits). Right-aligned buckets are exact.
PADDED_ONLY = ("deepseek_v4",)


def _resolve_backend(attn_backend: str, device: torch.device, dtype: torch.dtype, mean_len: float,
                     model_type: str | None = None) -> str:
    if attn_backend not in ATTN_BACKENDS:
        raise ValueError(f"compute_logprobs_entropy: attn_backend must be one of {ATTN_BACKENDS}, got {attn_backend!r}.")
    if model_type in PADDED_ONLY:
        if attn_backend in ("varlen", "block_diagonal"):
            raise ValueError(f"compute_logprobs_entropy: attn_backend={attn_backend!r} is wrong for {model_type} "
                             "(its attention cannot run packed); use 'bucketed' or 'auto'")
        return "bucketed"
    if attn_backend != "auto":
        return attn_backend
    from hybridrl.exact import ops

    if ops.active():  # rollout.exact: one packed row, the exact attention per sequence
        return "varlen"
    if device.type == "cuda" and flash_attn_usable(torch.empty(0, device=device, dtype=dtype)):
        return "varlen"
    if device.type == "cpu" and mean_len >= CPU_VARLEN_MIN_MEAN_LEN:
        return "varlen"
    return "bucketed"


def compute_logprobs_entropy(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    options: ForwardOptions = ForwardOptions(),
    moe: MoEForward | None = None,
    images: RowImages | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of the response tokens under ``model``.

    Args:
        model: a ``transformers`` causal LM (Qwen2 / Llama / Qwen3 family).
        input_ids: ``[B, L]`` long, prompt + response, right-padded (any padding works).
        attention_mask: ``[B, L]`` 0/1.
        response_mask: ``[B, L]`` 0/1, the positions to score (position 0 cannot be).
        options: temperature, padded or packed, lm_head chunk, entropy on/off, token budget
            per backbone call, attention backend; see :class:`ForwardOptions`.
        moe: MoE models only — replay recorded expert choices and/or collect the router
            logits of the real tokens (for the load-balancing loss); see :class:`MoEForward`.
        images: vision-language models (Qwen2.5-VL / Qwen3-VL) only — each row's images
            (``RowImages``, None for a text-only row); their features fill the row's image
            placeholders, positions are mRoPE per sequence (``trainer/vision_forward.py``).
            A sampled ``<|image_pad|>`` (not enclosed by vision start / end) is text.
    Returns:
        ``(logprobs, entropy)``, both ``[B, L]`` float32; ``logprobs[b, t] = log
        softmax(logits[b, t-1] / T)[input_ids[b, t]]`` (T = ``options.temperature``) where
        ``response_mask[b, t]``, 0 elsewhere; entropy of that same distribution.
        Differentiable under grad.
    """
    routed = getattr(model, FSDP_ROUTE, None)
    if routed is not None:  # FSDP2-sharded: through a registered forward method (see distributed/fsdp.py)
        return routed(input_ids, attention_mask, response_mask, options=options, moe=moe, images=images)
    return _logprobs_entropy(model, input_ids, attention_mask, response_mask, options=options, moe=moe,
                             images=images)


FSDP_ROUTE = "hybridrl_fsdp_logprobs_entropy"


def fsdp_forward_methods() -> dict:
    """``{attribute: fn}`` to install on an FSDP2-sharded policy (``shard_model``)."""
    return {FSDP_ROUTE: _logprobs_entropy}


@dataclass
class MoEForward:
    """What an MoE trainer forward does beyond the log-probs.

    ``routed_experts``: ``[B, L, n_moe_layers, k]`` expert ids recorded by the engine for
    these rows (-1 = none: the trainer's own choice), replayed in every backbone call
    (Rollout Routing Replay; ``hybridrl.rollout.routing.replay_routing``).
    ``router_logits``: when not None, the router logits of the real tokens are appended,
    one tuple per backbone call, one ``[T, E]`` tensor per MoE layer (the aux loss input).
    """

    routed_experts: torch.Tensor | None = None
    router_logits: list[tuple[torch.Tensor, ...]] | None = None

    def replay(self, model, tokens_routing: torch.Tensor | None):
        if self.routed_experts is None or tokens_routing is None:
            return contextlib.nullcontext()
        from hybridrl.rollout.routing import replay_routing

        return replay_routing(model, tokens_routing)

    @property
    def wants_logits(self) -> bool:
        return self.router_logits is not None


def _logprobs_entropy(model, input_ids, attention_mask, response_mask, *, options: ForwardOptions,
                      moe: MoEForward | None = None, images: RowImages | None = None):
    if input_ids.shape != attention_mask.shape or input_ids.shape != response_mask.shape:
        raise ValueError(
            "compute_logprobs_entropy: input_ids, attention_mask and response_mask must share shape [B, L], got "
            f"{tuple(input_ids.shape)}, {tuple(attention_mask.shape)}, {tuple(response_mask.shape)}."
        )
    lm_head = model.get_output_embeddings()
    if lm_head is None:
        raise ValueError(f"compute_logprobs_entropy: {type(model).__name__} has no output embeddings (lm_head).")
    batch, seq = input_ids.shape
    scored = (response_mask != 0) & (attention_mask != 0)
    scored[:, 0] = False  # nothing predicts the first token
    target_flat = scored.flatten().nonzero().squeeze(1)  # (N,) into (B*L)
    source_flat = target_flat - 1  # hidden state at t-1 predicts token t

    tokens = vision_tokens_of(model)
    if tokens is not None:
        if moe is not None:
            raise ValueError("compute_logprobs_entropy: MoE routing replay / router logits are not supported for "
                             "vision-language models")
        hidden_all, lookup = _vl_hidden_states(model, input_ids, attention_mask, options, images)
    elif images is not None and images.any:
        raise ValueError(f"compute_logprobs_entropy: images for {type(model).__name__}, not a vision-language model")
    else:
        with engine_selection(model):  # DeepSeek-V4: the engine's indexer choice (v4_indexer.py)
            hidden_all, lookup = _hidden_states(model, input_ids, attention_mask, options, moe,
                                                lm_head.weight.dtype)
    hidden_src = hidden_all[lookup[source_flat]]  # (N, D)
    logp, ent = chunked_logprobs_entropy(
        hidden_src, lm_head, input_ids.flatten()[target_flat], temperature=options.temperature,
        chunk_tokens=options.vocab_chunk_tokens,
    )
    zeros = torch.zeros(batch * seq, dtype=torch.float32, device=input_ids.device)
    logprobs = zeros.index_put((target_flat,), logp).view(batch, seq)
    entropy = (zeros.index_put((target_flat,), ent).view(batch, seq) if options.compute_entropy
               else zeros.view(batch, seq))
    return logprobs, entropy


def _hidden_states(model, input_ids, attention_mask, options: ForwardOptions, moe: MoEForward | None, dtype):
    """The backbone's hidden states ``[T, D]`` and ``lookup [B*L]`` (flat position -> row of
    them), padded (``options.packed=False``: every position) or packed (real tokens only)."""
    batch, seq = input_ids.shape
    if options.packed:
        mean_len = float((attention_mask != 0).sum()) / max(batch, 1)
        backend = _resolve_backend(options.attn_backend, input_ids.device, dtype, mean_len,
                                   getattr(model.config, "model_type", None))
        return _packed_forward(model, input_ids, attention_mask, backend, options.max_tokens_per_microbatch, moe)
    routing = None if moe is None else moe.routed_experts
    extra = {"output_router_logits": True} if moe is not None and moe.wants_logits else {}
    with (moe.replay(model, routing) if moe is not None else contextlib.nullcontext()):
        hidden = _backbone(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra)
    if extra:
        real = attention_mask.flatten().bool()
        moe.router_logits.append(tuple(r[real] for r in hidden.router_logits))
    return hidden.last_hidden_state.flatten(0, 1), torch.arange(batch * seq, device=input_ids.device)


def _vl_hidden_states(model, input_ids, attention_mask, options: ForwardOptions, images: RowImages | None):
    """``_hidden_states`` of a vision-language model (``trainer/vision_forward.py``)."""
    tokens = vision_tokens_of(model)
    if not options.packed:
        return (vl_padded_hidden(model, input_ids, attention_mask, images, tokens),
                torch.arange(input_ids.numel(), device=input_ids.device))
    mean_len = float((attention_mask != 0).sum()) / max(input_ids.shape[0], 1)
    backend = _resolve_backend(options.attn_backend, input_ids.device, model.dtype, mean_len)
    return _packed_forward(model, input_ids, attention_mask, backend, options.max_tokens_per_microbatch,
                           vision=(images, tokens))


def _packed_forward(model, input_ids, attention_mask, backend, max_tokens, moe=None, vision=None):
    """Hidden states of all real tokens ``[T, D]`` and ``lookup [B*L]`` (flat -> row of it).
    ``vision``: ``(images, tokens)`` of a vision-language model."""
    batch, seq = input_ids.shape
    lengths = (attention_mask != 0).sum(dim=1)
    if max_tokens is None:
        max_tokens = DEFAULT_BUCKET_TOKENS if backend == "bucketed" else int(lengths.sum()) * seq + 1
    groups = make_microbatches(lengths, max(max_tokens, int(lengths.max())))
    lookup = torch.full((batch * seq,), -1, dtype=torch.long, device=input_ids.device)
    pieces, offset = [], 0
    # a VL model runs its language model packed, never its vision tower (own attention, own cu_seqlens)
    attention_root = model if vision is None else language_model(model)
    with varlen_attention_for(attention_root) if backend == "varlen" else contextlib.nullcontext():
        for rows in groups:
            rows_t = torch.tensor(rows, device=input_ids.device)
            mask_g = attention_mask[rows_t]
            if vision is not None:
                images, tokens = vision
                hidden = vl_group_hidden(model, input_ids[rows_t], mask_g, None if images is None else images[rows],
                                         tokens, backend, rows)
            else:
                routed_g = None if moe is None or moe.routed_experts is None else moe.routed_experts[rows_t]
                hidden = _packed_hidden(model, input_ids[rows_t], mask_g, backend, routed_g, moe)  # (T_g, D)
            flat_g = unpad_indices(mask_g).indices  # (T_g,) into (n, L)
            flat = rows_t[flat_g // seq] * seq + flat_g % seq  # into (B, L)
            lookup[flat] = torch.arange(offset, offset + hidden.shape[0], device=input_ids.device)
            pieces.append(hidden)
            offset += hidden.shape[0]
    return torch.cat(pieces), lookup
