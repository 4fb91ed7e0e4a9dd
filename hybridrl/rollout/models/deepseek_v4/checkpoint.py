"""DeepSeek-V4's checkpoint names and quantized layout -> the Hugging Face names the engine loads.

Two on-disk forms of the same weights exist, and both load:

- **transformers' ``save_pretrained``**: DeepSeek's native module names under ``model.``
  (``model.layers.1.attn.wq_a.weight``, ``...ffn.experts.0.w1.weight``, ``model.embed_tokens.weight``,
  ``model.hc_head.hc_fn``, ``lm_head.weight``) in the training dtype;
- **the released checkpoint** (DeepSeek-V4-Flash and its base): the same names without the
  ``model.`` prefix and with DeepSeek's own leaves (``embed.weight``, ``head.weight``,
  ``norm.weight``, ``hc_head_fn``), the multi-token-prediction module as ``mtp.N.*``, and
  quantized weights:

  - block-FP8 linears: ``P.weight`` float8_e4m3fn ``[N, K]`` + ``P.scale`` ``[ceil(N/128),
    ceil(K/128)]``, float8_e8m0fnu (powers of two, ``quantization_config.scale_fmt: ue8m0``) or
    float32;
  - FP4 experts (``expert_dtype: fp4``): ``P.weight`` int8 ``[N, K/2]`` (two E2M1 codes per
    byte, element ``2j`` in the low nibble) + ``P.scale`` float8_e8m0fnu ``[N, K/32]`` — the
    OCP MXFP4 bytes of :mod:`hybridrl.quant.mxfp4`.

The renames are transformers' own (its ``deepseek_v4`` checkpoint conversion mapping, applied
key by key), so a name means what transformers means by it; the per-expert ``w1/w3/w2`` become
the ``gate_proj/up_proj/down_proj`` aliases the engine's fused experts accept (transformers
fuses them into ``gate_up_proj`` / ``down_proj`` with a converter, which needs all experts at
once — the engine takes them one by one).
"""

from __future__ import annotations

import functools
import re

import torch

MTP_PREFIX = "mtp."
SCALE_LEAF = ".scale"
_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.weight$")
_EXPERT_PROJ = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


@functools.cache
def _renamings():
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    return tuple(t for t in get_checkpoint_conversion_mapping("deepseek_v4") if isinstance(t, WeightRenaming))


def hf_name(disk_name: str) -> str:
    """The engine's (transformers') name for a V4 checkpoint tensor name of either form."""
    from transformers.core_model_loading import rename_source_key

    bare = disk_name.removeprefix("model.")
    renamed, _ = rename_source_key(bare, list(_renamings()), [])
    renamed = _EXPERT.sub(lambda m: f".experts.{m.group(1)}.{_EXPERT_PROJ[m.group(2)]}.weight", renamed)
    return renamed if renamed == "lm_head.weight" else "model." + renamed


def is_mtp(disk_name: str) -> bool:
    """A tensor of the multi-token-prediction module (``mtp.N.*``), which the engine does not run."""
    return disk_name.removeprefix("model.").startswith(MTP_PREFIX)


def scale_of(disk_name: str, names) -> str | None:
    """The checkpoint's scale tensor for the weight ``disk_name`` (``P.weight`` -> ``P.scale``), if any."""
    if not disk_name.endswith(".weight"):
        return None
    scale = disk_name[: -len(".weight")] + SCALE_LEAF
    return scale if scale in names else None


def is_scale(disk_name: str, names) -> bool:
    """``P.scale`` next to a ``P.weight``: consumed by that weight's dequantization."""
    return disk_name.endswith(SCALE_LEAF) and disk_name[: -len(SCALE_LEAF)] + ".weight" in names


def scale_to_float32(scale: torch.Tensor) -> torch.Tensor:
    """A checkpoint scale (float8_e8m0fnu powers of two, or float32) as float32."""
    from hybridrl.quant.mxfp4 import e8m0_to_float32

    if scale.dtype == torch.float8_e8m0fnu:
        return e8m0_to_float32(scale.view(torch.uint8))
    return scale.float()


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP4 expert ``[N, K/2]`` int8 + e8m0 ``[N, K/32]`` -> float32 ``[N, K]`` (OCP MXFP4 decode)."""
    from hybridrl.quant import mxfp4

    n, half = packed.shape
    if tuple(scale.shape) != (n, 2 * half // mxfp4.BLOCK):
        raise ValueError(f"FP4 scale of shape {tuple(scale.shape)} does not cover a [{n}, {2 * half}] weight in "
                         f"blocks of {mxfp4.BLOCK}; expected [{n}, {2 * half // mxfp4.BLOCK}]")
    return mxfp4.dequantize(packed.view(torch.uint8), scale.view(torch.uint8), torch.float32)
