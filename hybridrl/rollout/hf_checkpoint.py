"""Hugging Face checkpoint directories as ``(name, tensor)`` streams (safetensors, local only).

The stream feeds ``RolloutEngine.load_weights`` like any trainer's ``named_parameters()``:
a checkpoint is one more source for the same in-place weight update.

:func:`iter_model_weights` is what an engine loads: the raw stream with two checkpoint
layouts made plain —

- **block-FP8 weights** (DeepSeek-V3/R1's released layout, ``quantization_config.fmt:
  e4m3``, ``weight_block_size: [128, 128]``): ``X.weight`` is float8_e4m3fn ``[N, K]`` and
  ``X.weight_scale_inv`` float32 ``[ceil(N/128), ceil(K/128)]``; each weight is yielded
  dequantized (``w * scale_inv`` per 128x128 tile, float32) under its own name, and the
  scale names are consumed. The engine then stores it in its own layout (``fp8_block``
  re-quantizes it per tile again).
- **multi-token-prediction layers** (``num_nextn_predict_layers`` / ``num_mtp_layers``: the
  ``model.layers.{i}`` with ``i >= num_hidden_layers``) are skipped with one logged line:
  the engine samples one token per step.
- **DeepSeek-V4** (``model_type: deepseek_v4``): native names with or without ``model.``,
  ``P.scale`` tile scales (float8_e8m0fnu or float32), FP4 experts (int8 + e8m0 scales),
  ``mtp.N.*`` skipped — translated and dequantized by :mod:`hybridrl.rollout.models.deepseek_v4.checkpoint`.
- **Qwen2.5-VL** as released (``visual.*``, ``model.layers.*``): renamed to transformers 5's
  ``model.visual.*`` / ``model.language_model.*`` (:mod:`hybridrl.rollout.models.vision_language.checkpoint`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from typing import Any, Iterator

import torch

from hybridrl.rollout.models.deepseek_v4 import checkpoint as v4_checkpoint
from hybridrl.rollout.models.vision_language import checkpoint as vl_checkpoint

log = logging.getLogger(__name__)

SCALE_SUFFIX = "_scale_inv"
FP8_BLOCK = 128
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MTP_INDEX = re.compile(r"^(?:model\.)?(?:layers|mtp)\.(\d+)\.")


def _files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return ["model.safetensors"]
    raise ValueError(f"no model.safetensors or model.safetensors.index.json in {path!r}; "
                     f"pass a local Hugging Face checkpoint directory saved with safetensors")


def iter_safetensors_dir(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) from `model.safetensors` or the shards listed in `model.safetensors.index.json`."""
    from safetensors import safe_open

    for file in _files(path):
        with safe_open(os.path.join(path, file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def checkpoint_names(path: str) -> dict[str, str]:
    """Every tensor name in the checkpoint -> the file holding it (headers only, no data read)."""
    from safetensors import safe_open

    names = {}
    for file in _files(path):
        with safe_open(os.path.join(path, file), framework="pt") as f:
            names.update(dict.fromkeys(f.keys(), file))
    return names


def mtp_layer_names(names, hf_config: Any) -> list[str]:
    """The names of multi-token-prediction tensors: layers with index >= ``num_hidden_layers``
    (DeepSeek-V3) or DeepSeek-V4's ``mtp.N.*`` module."""
    if _is_v4(hf_config):
        return [name for name in names if v4_checkpoint.is_mtp(name)]
    n = getattr(hf_config, "num_hidden_layers", None)
    if n is None:
        return []
    return [name for name in names if (m := _LAYER.match(name)) and int(m.group(1)) >= n]


def _is_v4(hf_config: Any) -> bool:
    return getattr(hf_config, "model_type", None) == "deepseek_v4"


def weight_sources(names: dict[str, str], hf_config: Any) -> dict[str, tuple[str, str | None]]:
    """The engine's name -> (the tensor on disk, its scale tensor or None) for every model
    weight of a checkpoint whose headers list ``names`` (:func:`checkpoint_names`): scales are
    consumed by their weights, MTP tensors skipped, DeepSeek-V4 names translated."""
    skip = set(mtp_layer_names(names, hf_config))
    sources = {}
    if _is_v4(hf_config):
        for name in names:
            if name not in skip and not v4_checkpoint.is_scale(name, names):
                sources[v4_checkpoint.hf_name(name)] = (name, v4_checkpoint.scale_of(name, names))
        return sources
    for name in names:
        if name not in skip and not name.endswith(SCALE_SUFFIX):
            scale = name + SCALE_SUFFIX
            sources[vl_checkpoint.engine_name(name, hf_config)] = (name, scale if scale in names else None)
    return sources


def model_weight_names(names: dict[str, str], hf_config: Any) -> set[str]:
    """The names :func:`iter_model_weights` yields for a checkpoint whose headers list
    ``names`` (:func:`checkpoint_names`)."""
    return set(weight_sources(names, hf_config))


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """float8 ``[N, K]`` x float32 tile scales ``[ceil(N/b), ceil(K/b)]`` -> float32 ``[N, K]``."""
    N, K = weight.shape
    if tuple(scale_inv.shape) != (-(-N // block), -(-K // block)):
        raise ValueError(f"FP8 scale of shape {tuple(scale_inv.shape)} does not tile a [{N}, {K}] weight in "
                         f"{block}x{block} blocks; the checkpoint's weight_block_size must be [{block}, {block}]")
    scale = scale_inv.float().repeat_interleave(block, 0)[:N].repeat_interleave(block, 1)[:, :K]
    return weight.float() * scale


def _dequantize(path: str, name: str, tensor: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """One checkpoint tensor in float32 / as stored: block-FP8 (float32 or e8m0 tile scales) or
    FP4 (int8 pairs of E2M1 codes + e8m0 scales per 32) dequantized; anything else unchanged."""
    if scale is None:
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"checkpoint {path}: {name} is stored in {tensor.dtype} without a scale tensor; only "
                             f"block-FP8 checkpoints (weight + weight_scale_inv, or DeepSeek-V4's .scale) load")
        return tensor
    if tensor.dtype in (torch.int8, torch.uint8):
        return v4_checkpoint.dequantize_fp4(tensor, scale)
    return dequantize_block_fp8(tensor, v4_checkpoint.scale_to_float32(scale))


def iter_model_weights(path: str, hf_config: Any, names: dict[str, str] | None = None
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's model weights under the engine's names, quantized ones dequantized and
    MTP tensors skipped (module docstring); ``names``: its :func:`checkpoint_names` when already read."""
    from safetensors import safe_open

    names = checkpoint_names(path) if names is None else names
    skip = mtp_layer_names(names, hf_config)
    if skip:
        layers = sorted({int(m.group(1)) for n in skip if (m := _MTP_INDEX.match(n))})
        log.info("checkpoint %s: skipping %d tensors of multi-token-prediction layer(s) %s (the rollout "
                 "engine predicts one token per step)", path, len(skip), layers)
    with contextlib.ExitStack() as stack:
        handles = {file: stack.enter_context(safe_open(os.path.join(path, file), framework="pt"))
                   for file in sorted(set(names.values()))}
        for engine_name, (name, scale_name) in weight_sources(names, hf_config).items():
            scale = None if scale_name is None else handles[names[scale_name]].get_tensor(scale_name)
            yield engine_name, _dequantize(path, name, handles[names[name]].get_tensor(name), scale)
