"""VL checkpoint names on disk -> the engine's (transformers 5's) names.

Qwen2-VL and Qwen2.5-VL checkpoints as released (and as transformers 5 still saves them)
name the tower ``visual.*`` and the language model ``model.*``; transformers 5's modules, and
so the engine and every trainer, name them ``model.visual.*`` and ``model.language_model.*``.
Qwen3-VL checkpoints already use the latter. ``lm_head.weight`` is the same in both.
"""

from __future__ import annotations

from typing import Any

VL_MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl")
_NEW = ("model.visual.", "model.language_model.")


def engine_name(name: str, hf_config: Any) -> str:
    """``name`` of a checkpoint tensor as the engine's route table spells it."""
    if getattr(hf_config, "model_type", None) not in VL_MODEL_TYPES or name.startswith(_NEW):
        return name
    if name.startswith("visual."):
        return "model." + name
    if name.startswith("model."):
        return "model.language_model." + name[len("model."):]
    return name
