"""What the trainer does to a vision-language policy's structure: which parameters are the
vision tower's, and freezing them (``model.freeze_vision``)."""

from __future__ import annotations

import torch

# transformers' Qwen2-VL / Qwen2.5-VL / Qwen3-VL keep the vision tower (patch embedding,
# blocks, merger, Qwen3-VL's deepstack mergers) under ``model.visual``; older checkpoints
# and peft-wrapped models put a prefix before it.
VISION_MODULE = "visual"


def is_vision_name(name: str) -> bool:
    """A parameter / module name inside the vision tower."""
    return VISION_MODULE in name.split(".")


def vision_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if is_vision_name(n)]


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """Stop gradients into the vision tower (its parameters get ``requires_grad=False``, so the
    optimizer, built over trainable parameters, skips them). Returns how many were frozen;
    a ValueError for a model without a vision tower (``model.freeze_vision`` on a text model)."""
    params = vision_parameters(model)
    if not params:
        raise ValueError(f"model.freeze_vision=true: {type(model).__name__} has no vision tower "
                         f"('{VISION_MODULE}' parameters); it is for vision-language models")
    for _, p in params:
        p.requires_grad_(False)
    return len(params)
