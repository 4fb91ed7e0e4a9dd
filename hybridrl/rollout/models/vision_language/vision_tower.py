"""The vision tower: transformers' own module (``Qwen2_5_VisionTransformerPretrainedModel``,
``Qwen3VLVisionModel``) built from ``hf_config.vision_config``, never re-implemented.

It stays in the engine dtype whatever ``spec.quantization`` does to the language model
(the quantized linear methods only ever reach our own ``LinearBase`` layers), and it is
replicated whole on every tensor-parallel rank (its routes have no ``tp`` slice). Each of
its parameters gets the plain in-place ``copy_loader``, so the route table routes it by its
own name (``model.visual...``) and load and refit write it through the same bracket as the
rest, keeping every address.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hybridrl.data.vision import ImageInputs
from hybridrl.rollout.layers.norm import copy_loader
from hybridrl.rollout.models.vision_language.config import VlDims

TOWER_ATTENTION = "sdpa"
"""the tower's attention kernel (transformers' name): torch SDPA, on every device."""


def build_vision_tower(dims: VlDims, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """transformers' vision module for ``dims.vision_config`` on ``device`` (the meta device
    counts its weights without memory), in ``dtype``, frozen, every parameter loadable."""
    from transformers import AutoModel

    config = dims.vision_config.__class__.from_dict(dims.vision_config.to_dict())
    config._attn_implementation = TOWER_ATTENTION
    with torch.device(device):
        tower = AutoModel.from_config(config, dtype=dtype)
    tower.requires_grad_(False).eval()
    for p in tower.parameters():
        p.weight_loader = copy_loader
    return tower


@dataclass
class ImageFeatures:
    """The tower's output for some images, split per image."""

    features: list[torch.Tensor]
    """per image ``[tokens_i, hidden]``: what its image tokens are embedded as."""
    deepstack: list[list[torch.Tensor]]
    """per image, one ``[tokens_i, hidden]`` per deepstack layer (Qwen3-VL; else empty lists)."""


class VisionCounter:
    """Tower calls and patches encoded (tests and benchmarks read it: prefix reuse means
    a retained conversation's images are not encoded again)."""

    def __init__(self):
        self.calls = self.images = self.patches = 0


@torch.inference_mode()
def encode_images(tower: nn.Module, images: ImageInputs, counter: VisionCounter) -> ImageFeatures:
    """One tower call over ``images`` (as transformers' ``get_image_features``)."""
    param = next(tower.parameters())
    pixels = images.pixel_values.to(device=param.device, dtype=param.dtype)
    grid = images.grid_thw.to(param.device)
    out = tower(pixels, grid_thw=grid, return_dict=True)
    sizes = images.features_per_image(tower.spatial_merge_size)
    deepstack = [torch.split(f, sizes) for f in (getattr(out, "deepstack_features", None) or [])]
    counter.calls += 1
    counter.images += images.n_images
    counter.patches += int(images.pixel_values.shape[0])
    return ImageFeatures(list(torch.split(out.pooler_output, sizes)),
                         [[d[i] for d in deepstack] for i in range(len(sizes))])
