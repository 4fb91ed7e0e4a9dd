"""Trainer log-probs with each group's prompt computed once (shared-prefix forward).

A GRPO batch holds ``n`` responses per prompt; the plain forward runs every prompt ``n``
times. Here the backbone runs once over the ``G`` distinct prompts (keeping their KV
cache), then once over the ``B`` responses attending to their group's cached prompt
(the cache rows are gathered per response row, so gradients from all ``n`` responses
accumulate into the one prompt pass). The first response token is predicted by the
prompt's last hidden state, the others by the response pass.

Rows: ``input_ids [B, L]`` right-padded ``prompt + response``; ``prompt_len [B]`` long;
``group [B]`` long, equal for rows whose prompts are identical. Outputs are aligned
exactly like :func:`hybridrl.trainer.forward.compute_logprobs_entropy`.
"""

from __future__ import annotations

import torch

from hybridrl.trainer.forward import _backbone, chunked_logprobs_entropy


STATEFUL_CACHE_MODELS = ("deepseek_v4",)
"""Models whose transformers cache is stateful (DeepSeek-V4's compressor buffers): a prompt's
cache cannot be expanded to its group's rows, so they take the plain forward."""


def prefix_cache_expandable(model) -> bool:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) not in STATEFUL_CACHE_MODELS


def shared_prefix_logprobs_entropy(model, input_ids, attention_mask, response_mask, prompt_len, group, *,
                                   temperature: float = 1.0, vocab_chunk_tokens: int = 1024):
    """``(logprobs, entropy)`` ``[B, L]`` float32, zeros outside ``response_mask``."""
    routed = getattr(model, FSDP_ROUTE, None)
    if routed is not None:  # FSDP2-sharded: through a registered forward method (see distributed/fsdp.py)
        return routed(input_ids, attention_mask, response_mask, prompt_len, group, temperature=temperature,
                      vocab_chunk_tokens=vocab_chunk_tokens)
    return _shared_prefix(model, input_ids, attention_mask, response_mask, prompt_len, group,
                          temperature=temperature, vocab_chunk_tokens=vocab_chunk_tokens)


FSDP_ROUTE = "hybridrl_fsdp_shared_prefix"


def fsdp_forward_methods() -> dict:
    """``{attribute: fn}`` to install on an FSDP2-sharded policy (``shard_model``)."""
    return {FSDP_ROUTE: _shared_prefix}


def _shared_prefix(model, input_ids, attention_mask, response_mask, prompt_len, group, *, temperature,
                   vocab_chunk_tokens):
    B, L = input_ids.shape
    dev = input_ids.device
    _, first = _first_row_of_each_group(group)  # (G,) row holding each group's prompt
    row_group = torch.searchsorted(torch.unique(group), group)  # (B,) group slot of each row
    p_len_g = prompt_len[first]  # (G,)
    P = int(p_len_g.max())
    slots = torch.arange(P, device=dev)
    prompt_mask = (slots < p_len_g[:, None]).long()  # (G, P)
    prompt_ids = input_ids[first, :P] * prompt_mask  # (G, P), tokens past a prompt zeroed
    backbone = _backbone(model)
    out = backbone(input_ids=prompt_ids, attention_mask=prompt_mask, use_cache=True)
    prompt_hidden = out.last_hidden_state  # (G, P, D)
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    cache.batch_select_indices(row_group)  # (B, H, P, Dh) per layer, differentiable gather

    total_len = attention_mask.sum(-1)  # (B,)
    resp_len = total_len - prompt_len
    R = int(resp_len.max())
    r_slots = torch.arange(R, device=dev)
    resp_valid = (r_slots < resp_len[:, None]).long()  # (B, R)
    src = (prompt_len[:, None] + r_slots).clamp(max=L - 1)  # (B, R)
    resp_ids = input_ids.gather(1, src) * resp_valid
    mask = torch.cat([prompt_mask[row_group], resp_valid], dim=1)  # (B, P + R)
    position_ids = prompt_len[:, None] + r_slots  # (B, R)
    resp_hidden = backbone(input_ids=resp_ids, attention_mask=mask, position_ids=position_ids,
                           use_cache=True, **{_cache_kwarg(backbone): cache}).last_hidden_state  # (B, R, D)

    # hidden that predicts response token j of row i: j == 0 -> prompt's last; else resp[j-1]
    first_h = prompt_hidden[row_group, p_len_g[row_group] - 1]  # (B, D)
    hidden = torch.cat([first_h[:, None], resp_hidden[:, :-1]], dim=1)  # (B, R, D)
    scored = resp_valid.bool() & (response_mask.gather(1, src) != 0)  # (B, R)
    targets = resp_ids[scored]
    logp, ent = chunked_logprobs_entropy(hidden[scored], model.get_output_embeddings(), targets,
                                         temperature=temperature, chunk_tokens=vocab_chunk_tokens)
    flat = (torch.arange(B, device=dev)[:, None] * L + src)[scored]  # into (B*L)
    zeros = torch.zeros(B * L, dtype=torch.float32, device=dev)
    return zeros.index_put((flat,), logp).view(B, L), zeros.index_put((flat,), ent).view(B, L)


def _cache_kwarg(backbone) -> str:
    """transformers renamed ``past_key_values`` to ``cache`` (5.x, with a deprecation period)."""
    import inspect

    return "cache" if "cache" in inspect.signature(backbone.forward).parameters else "past_key_values"


def _first_row_of_each_group(group: torch.Tensor):
    """``(unique ids (G,), first row of each (G,))`` in ascending id order."""
    uniq, inverse = torch.unique(group, return_inverse=True)
    rows = torch.arange(group.numel(), device=group.device)
    first = torch.full((uniq.numel(),), group.numel(), dtype=torch.long, device=group.device)
    first.scatter_reduce_(0, inverse, rows, reduce="amin")
    return uniq, first
