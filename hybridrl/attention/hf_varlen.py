"""Packed (padding-free) forwards for Hugging Face ``transformers`` 5 causal LMs.

transformers routes attention through ``AttentionInterface`` by
``config._attn_implementation`` and builds masks through ``AttentionMaskInterface``
under the same name. We register one name, :data:`VARLEN_ATTN`:

- its mask function returns ``None``: transformers builds no mask at all (for packed
  ``position_ids`` its sdpa/eager builders would make a ``[1, 1, T, T]`` block-diagonal
  mask);
- its attention function reads the ``cu_seq_lens_q`` / ``max_length_q`` kwargs that
  the model forwards from its call (transformers' ``FlashAttentionKwargs``) and runs
  :func:`hybridrl.attention.varlen.varlen_attention` (flash-attn varlen or the SDPA
  per-sequence fallback).

Call the backbone with ``input_ids [1, T]``, ``position_ids [1, T]`` restarting per
sequence (for rotary embeddings) and those kwargs inside :func:`varlen_attention_for`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from hybridrl.attention.hf_attention import attention_implementation, register_maskless
from hybridrl.attention.varlen import varlen_attention

VARLEN_ATTN = "hybridrl_varlen"


def _attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """AttentionInterface signature: q ``[1, H, T, D]``, k/v ``[1, H_kv, T, D]`` -> ``([1, T, H, D], None)``."""
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    max_seqlen = kwargs.get("max_length_q")
    if cu_seqlens is None or max_seqlen is None or query.shape[0] != 1:
        raise ValueError(
            f"{VARLEN_ATTN} attention needs one packed row plus cu_seq_lens_q/max_length_q kwargs; "
            "call it through hybridrl.trainer.forward or pass them to the model's forward."
        )
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    out = varlen_attention(q, k, v, cu_seqlens, int(max_seqlen), scale=scaling, dropout_p=dropout)
    return out.unsqueeze(0), None  # (1, T, H, D)


def register() -> None:
    """Register :data:`VARLEN_ATTN` with transformers (idempotent)."""
    register_maskless(VARLEN_ATTN, _attention_forward)


@contextlib.contextmanager
def varlen_attention_for(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` with :data:`VARLEN_ATTN` inside the block, restoring its own after.
    Under batch-invariant numerics (``rollout.exact``) the packed row runs the exact
    engine's attention instead (``hybridrl/exact/attention.py``), per sequence."""
    from hybridrl.exact import ops

    if ops.active():
        from hybridrl.exact.attention import exact_attention_for

        with exact_attention_for(model):
            yield
        return
    register()
    with attention_implementation(model, VARLEN_ATTN):
        yield
