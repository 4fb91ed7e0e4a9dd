"""Attention masks in each kernel's format and padding removal (packing)."""

from hybridrl.attention.masks import (
    additive_mask,
    decode_mask,
    npu_compressed_causal_mask,
    npu_fusion_attention_mask,
    sdpa_mask,
)
from hybridrl.attention.packing import Unpadded, make_microbatches, pad, padding_fraction, unpad, unpad_indices
from hybridrl.attention.varlen import set_flash_attn_enabled, varlen_attention

__all__ = [
    "Unpadded",
    "additive_mask",
    "decode_mask",
    "make_microbatches",
    "npu_compressed_causal_mask",
    "npu_fusion_attention_mask",
    "pad",
    "padding_fraction",
    "sdpa_mask",
    "set_flash_attn_enabled",
    "unpad",
    "unpad_indices",
    "varlen_attention",
]
