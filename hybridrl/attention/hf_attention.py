"""Registering an attention function with transformers, and running a model with it for a
block: what the packed trainer attention (``hf_varlen.py``) and the exact attention
(``hybridrl/exact/attention.py``) share."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def _no_mask(*args, **kwargs) -> None:
    return None


def register_maskless(name: str, attention_forward) -> None:
    """Register an attention function with transformers under ``name``, with a mask
    function that builds no mask (the function reads its own kwargs); idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, _no_mask)


@contextlib.contextmanager
def attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    """``model`` runs attention implementation ``name`` inside the block, its own after."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
